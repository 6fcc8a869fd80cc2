"""What a backend did to a model: the report its apply() returns, the one thing the loop, the drafter and the
scripts read about a backend (never its modules' attributes). A model no backend serves has the default report of
model.py's PyTorch. The backends: cpu/ (few_rows.cpp) and gpu.py (tinygemm int4), applied by loading.load_model.
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
    one_call_step: bool = False  # a decode or verify step is one kernel call
    compile_steps: bool = True  # torch.compile may wrap the steps; False: they run as they are (eagerly)
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


def warn(backend: str, message: str, runs: str = "the model runs on model.py's PyTorch path"):
    """Every backend's refusal is this one line; the model still runs."""
    print(f"warning: {backend} backend: {message}; {runs}", file=sys.stderr)


def weights(model) -> dict:
    """The weights the model holds: its parameters and persistent buffers (a quantized layer's codes and scales)."""
    return {id(t): t for t in model.state_dict(keep_vars=True).values()}


def step_bytes(model, streamed=None) -> int:
    """Bytes of weights one decode step reads: every weight once, an untied embedding table one row. `streamed`:
    {module: the tensors a backend reads in place of that module's own weights}."""
    tensors = weights(model)
    for module, instead in (streamed or {}).items():
        for t in module.state_dict(keep_vars=True).values():
            tensors.pop(id(t), None)
        tensors.update({id(t): t for t in instead if t is not None})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not model.args.tie_embeddings:
        embedding = model.tok_embeddings.weight
        total -= embedding.numel() * embedding.element_size()
    return total


def held_bytes(model, extra=()) -> int:
    """Bytes of weights the process holds, each storage counted once: the model's weights and `extra`, a
    backend's own layouts of them."""
    tensors = [t for t in list(weights(model).values()) + list(extra) if isinstance(t, torch.Tensor) and not t.is_meta]
    return sum({(t.data_ptr(), t.nbytes): t.nbytes for t in tensors}.values())
