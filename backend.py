"""What a backend did to a model: the report its apply() returns, the one thing the loop, the drafter and the
scripts read about a backend (never its modules' attributes). A model no backend serves has the default report of
model.py's PyTorch. The backends: cpu/ (few_rows.cpp) and gpu.py (Triton), applied by loading.load_model.
"""
import dataclasses
import sys

import torch

import model as model_py


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


TOLERANCE = 0.01  # a product's kernel against its reference: the RMS of their difference over the reference's RMS


def relative_error(want, got) -> float:
    want, got = want.float(), got.float()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30)).item()


def within_tolerance(want, got) -> str | None:
    error = relative_error(want, got)
    return None if error <= TOLERANCE else f"it differs from its reference by {error:.2g} (bound {TOLERANCE})"


def spot_check(rows, reference_rows, n=5, close=within_tolerance) -> str | None:
    """rows(a, b) and reference_rows(a, b): rows a .. b - 1 (along dimension -2) of a kernel's output and of its
    reference's. None where each of n rows is as it is computed alone, bit for bit, and close(reference, kernel) finds
    them close; else why not. Any exception, the kernel's or its reference's (a fork's edited signature), is a why."""
    try:
        with torch.no_grad():
            together = rows(0, n)
            if not all(torch.equal(together[..., i:i + 1, :], rows(i, i + 1)) for i in range(n)):
                return "its rows differ from the same rows computed alone"
            return close(reference_rows(0, n), together)
    except Exception as e:  # noqa: BLE001 (whatever a kernel or an edited reference raises refuses it)
        return refusal(e)


def refusal(e: Exception) -> str:
    """An exception as a check's why: its type and its first line."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else 'raised'}"


def op_key(model, op: str) -> tuple:
    """What check_op's verdict depends on: the op, the model's dtype and the shapes and settings it checks at."""
    args, attention = model.args, model.layers[0].attention
    dtype = model.tok_embeddings.weight.dtype
    if op == "rms_norm":
        return op, dtype, args.dim, args.head_dim, args.norm_eps
    return (op, dtype, attention.n_kv_heads, attention.n_heads // attention.n_kv_heads, args.head_dim, attention.scale,
            args.max_seq_len)


# half a step of an output of each dtype, relative
ROUNDING = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}


def check_norm(weight, eps, rows, exact_norm, kernel, reference, randn) -> str | None:
    """An RMSNorm kernel against its reference at one width, eps and weight (check_op)."""
    dim, dtype = weight.shape[-1], weight.dtype
    # rows of magnitudes 1e-3 .. 1e3, a few massive activations among them (as Qwen's)
    x = randn(1, rows, dim) * torch.logspace(-3, 3, rows, device=weight.device)[None, :, None].to(dtype)
    x[0, 0, :3] = 3e3

    def norm(f):
        return lambda a, b: f(x[:, a:b], weight, eps)

    def exact(want, got):
        if torch.equal(want, got):
            return None
        return (f"{int((want != got).sum())} of its {want.numel()} outputs at dim {dim} differ from model.py's "
                f"rms_norm, which it is built to equal bit for bit (edited?)")

    def close(want, got):
        error = (got.float() - want.float()).abs()
        if (error <= 4 * ROUNDING[dtype] * want.float().abs()).all():
            return None
        return f"it differs from model.py's rms_norm by {error.max().item():.2g} at dim {dim} (edited?)"
    return spot_check(norm(kernel), norm(reference), rows, exact if exact_norm else close)


def check_op(model, op: str, kernel, rows: int = 5, exact_norm: bool = True) -> str | None:
    """The kernel of model.py's op `op` (rms_norm or attention) held to the op's reference at this model's own
    shapes: RMSNorm at its dim, eps and weight, bit for bit where the kernel is built to be exact (the CPU's; else
    within two roundings of the output: the Triton kernel sums the squares in another order); attention at its KV
    heads, query heads a KV head, head_dim and scale, over a cache of its whole context, `rows` tokens at positions
    spread over that context seeing what model.visible_slots gives them, within its own rounding of a float32
    reference (a step of the output, 2^-7 relative in bf16, plus float32 sums over the slots). -> None where it
    serves, else why not, in words."""
    args, attention = model.args, model.layers[0].attention
    weight = model.tok_embeddings.weight
    dtype, device = weight.dtype, weight.device
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
    if op == "rms_norm":  # at each width the model norms: dim, and head_dim where q and k are normed
        norms = [model.layers[0].attention_norm] + ([attention.q_norm] if args.qk_norm else [])
        for module in norms:
            why = check_norm(module.weight.detach(), module.eps, rows, exact_norm, kernel, model_py.rms_norm, randn)
            if why is not None:
                return why
        return None
    # one KV head's G query heads (the kernels compute each KV head alike); keys and values a random block of 4099
    # slots repeated, each repeat made distinct by a ramp (random numbers for the whole context took ~0.3 s)
    groups, hd, context = attention.n_heads // attention.n_kv_heads, args.head_dim, args.max_seq_len
    scale = attention.scale
    positions = torch.linspace(0, context - 1, rows, device=device).long()[None]
    visible = model_py.visible_slots(positions, context)
    q = randn(1, 1, groups, rows, hd, scale=3.0)
    ramp = torch.linspace(-1, 1, context, device=device, dtype=dtype)[:, None]
    k, v = (randn(1, 1, 4099, hd).repeat(1, 1, context // 4099 + 1, 1)[:, :, :context] + sign * ramp
            for sign in (1, -1))

    def attend(f, cast=lambda t: t):
        def rows_of(a, b):
            y = f(cast(q[:, :, :, a:b].reshape(1, 1, groups * (b - a), hd)), cast(k), cast(v), visible[:, a:b], scale)
            return y.view(1, 1, groups, b - a, hd)
        return rows_of
    seen = visible.sum(-1).amax().item()

    def close(want, got):
        # (the reference in float32 too: its own sums' error counted twice)
        bound = 2 * ROUNDING[dtype] * want.abs() + 2 ** -21 * seen ** 0.5 * v.abs().max().float()
        error = (got.float() - want).abs()
        if (error <= bound).all():
            return None
        return (f"it differs from a float32 reference by {error.max().item():.2g} where its rounding allows "
                f"{bound.flatten()[error.argmax()].item():.2g} (context {context}, head_dim {hd})")
    return spot_check(attend(kernel), attend(model_py.attention, torch.Tensor.float), rows, close)


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
