"""What a backend did to a model: the report its apply() returns, the one thing the loop, the drafter and the
scripts read about a backend (never its modules' attributes). A model no backend serves has the default report of
model.py's PyTorch. The backends: cpu/ (few_rows.cpp) and gpu.py (Triton), applied by loading.load_model.
"""
import dataclasses
import sys

import torch


# Tokens a row of the longest verify anything runs or checks (K = 16 drafts + 1; a longer verify paid on no CPU or GPU
# measured). A backend's report may lower it (max_verify_tokens): what it computes exactly.
LONGEST_VERIFY = 17


@dataclasses.dataclass(frozen=True)
class Report:
    name: str = "torch"  # "cpu", "cuda", or "torch": model.py's PyTorch alone
    serves: str = "nothing (model.py's PyTorch)"  # what it serves, in words
    sizes_threads: bool = False  # its steps give the same results on any thread count: the loop may follow free cores
    step_bytes: int = 0  # bytes of weights one decode step reads
    held_bytes: int = 0  # bytes of weights this process holds (a tensor-parallel rank: its shard)
    # The longest verify a row (K + 1 tokens) it computes as a decode would; None: no limit it checked (model.py's
    # PyTorch path; on CUDA where not even 2 rows held, which gpu.apply says in a warning line).
    max_verify_tokens: int | None = None
    fallback: str | None = None  # why it does not serve, where it refused


def report(model) -> Report:
    """The report of the backend that serves `model`, or model.py's own (made once, at the first call)."""
    if "backend_report" not in model.__dict__:
        attach(model, torch_report(model))
    return model.__dict__["backend_report"]


def attach(model, report_: Report) -> Report:
    model.__dict__["backend_report"] = report_
    return report_


def torch_report(model, fallback=None) -> Report:
    return Report(step_bytes=step_bytes(model), held_bytes=held_bytes(model), fallback=fallback)


TOLERANCE = 0.01  # a kernel against its reference: the RMS of their difference over the reference's RMS


def relative_error(want, got) -> float:
    want, got = want.float(), got.float()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30)).item()


def spot_check(rows, reference_rows, n=5) -> str | None:
    """rows(a, b) and reference_rows(a, b): rows a .. b - 1 (along dimension -2) of a kernel's output and of its
    reference's. None where each of n rows is as it is computed alone, bit for bit, and the kernel within TOLERANCE of
    the reference; else why not."""
    with torch.no_grad():
        together = rows(0, n)
        if not all(torch.equal(together[..., i:i + 1, :], rows(i, i + 1)) for i in range(n)):
            return "its rows differ from the same rows computed alone"
        error = relative_error(reference_rows(0, n), together)
    return None if error <= TOLERANCE else f"it differs from its reference by {error:.2g} (bound {TOLERANCE})"


def warn(backend: str, message: str, runs: str = "the model runs on model.py's PyTorch path"):
    """Every backend's refusal is this one line; the model still runs."""
    print(f"warning: {backend} backend: {message}; {runs}", file=sys.stderr)


def weights(model) -> dict:
    """The weights the model holds: its parameters and buffers (a quantized layer's codes and scales, a backend's
    layouts of them), not its KV cache and rotary tables."""
    tensors = [t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.endswith(("k_cache", "v_cache", "rope_cos", "rope_sin"))]
    return {id(t): t for t in tensors if t is not None}


def step_bytes(model) -> int:
    """Bytes of weights one decode step reads: every weight once, the embedding table one row (all of it where the LM
    head reads it as its weight)."""
    total = sum(t.numel() * t.element_size() for t in weights(model).values())
    embedding = model.tok_embeddings.weight
    if getattr(model.output, "weight", None) is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def held_bytes(model) -> int:
    """Bytes of weights the process holds, each storage counted once."""
    tensors = [t for t in weights(model).values() if not t.is_meta]
    return sum({(t.data_ptr(), t.nbytes): t.nbytes for t in tensors}.values())
