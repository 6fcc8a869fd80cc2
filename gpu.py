"""The CUDA backend: int4 layers on aten's tinygemm kernel, applied around model.py by loading.load_model (backend
"auto" on a CUDA device), as tp.apply_tp is. (Named gpu.py: a module named cuda would shadow NVIDIA's cuda package,
which torch imports.) Results on hardware: docs/cuda.md.

int8 and MX layers need no backend on CUDA: their reference forwards run inside the compiled step (int8 in the
gpt-fast form, the codes cast inside the product). Int4Linear's on-disk layout is tinygemm's arithmetic, w = (q - 8) *
scale + zero per group with scales_and_zeros [K/g, N, 2], so the backend only repacks the codes once at load (two
codes per byte, the even one in the high nibble, then _convert_weight_to_int4pack) and multiplies with
_weight_int4pack_mm: the weight is never dequantized. Inputs are rounded as the reference rounds them
(quantize.round_activations), and each packed layer proves itself against the reference forward before it serves.

Exact speculation rests on a verify computing each of its K + 1 rows as a decode step computes its one row. On CUDA
that is not given (cuBLAS picks kernels by shape, attention splits by query length), so before the model serves,
exact_verify_tokens runs one product of each shape and the attention at 1 and up to backend.LONGEST_VERIFY rows, bit
for bit, and the report says the longest verify that held (backend.Report.max_verify_tokens). The target's steps are
compiled without coordinate-descent tuning (speculative.compile_options), which would rewrite one-row products only.
"""
import dataclasses

import torch
import torch.nn as nn

import backend
import mx
import quantize

TOLERANCE = 0.01  # relative RMS against the reference forward, in bf16
RUNS_REFERENCE = "int4 layers run quantize.py's reference forward"


class TinyGemmInt4Linear(nn.Module):
    def __init__(self, ref: quantize.Int4Linear):
        super().__init__()
        n, k = ref.out_features, ref.in_features
        self.groupsize, self.in_features, self.bias = ref.groupsize, k, ref.bias
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        codes = mx.unpack(ref.weight, 4)  # [N, K], element 2i was the low nibble on disk
        packed = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles))
        self.register_buffer("scales_and_zeros", ref.scales_and_zeros.to(torch.bfloat16).contiguous())
        self.out_features = n

    def forward(self, x):
        rows = quantize.round_activations(x).reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.groupsize, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def refusal(model, int4) -> str | None:
    """Why tinygemm cannot run these int4 layers (not bf16, an older GPU, a shape it does not take), or None."""
    major, minor = torch.cuda.get_device_capability(int4[0][1].weight.device)
    if major < 8:
        return f"tinygemm needs compute capability 8.0 or newer (this GPU: {major}.{minor})"
    if model.tok_embeddings.weight.dtype != torch.bfloat16:
        return "tinygemm takes bf16 inputs (use --dtype bf16)"
    for name, m in int4:
        if m.in_features % 32 or m.out_features % 8:
            return (f"{name}: in_features {m.in_features} / out_features {m.out_features} do not fit tinygemm "
                    "(multiples of 32 / 8)")
    return None


def apply(model) -> backend.Report:
    """Swap the int4 layers of a CUDA model for tinygemm ones, each checked against its reference forward on random
    inputs before it replaces it (the reference is dropped as it goes: no second copy of the model at the peak);
    where tinygemm cannot run, or a layer does not match, the reference serves, with one warning line. Then the
    rows check (exact_verify_tokens) sets the longest verify it serves exactly."""
    report = try_to_serve(model)
    rows, difference = exact_verify_tokens(model)
    if rows < 2:
        backend.warn("CUDA", f"a verify does not compute its rows as a decode step does ({difference})",
                     "speculation runs, its output plain decoding's except where two logits are that close")
        return backend.attach(model, report)
    return backend.attach(model, dataclasses.replace(report, max_verify_tokens=rows))


def in_features(m) -> int | None:
    """A product module's inputs (None: not a product)."""
    return m.in_features if isinstance(m, (nn.Linear, TinyGemmInt4Linear, *quantize.FORMATS.values())) else None


def products(model) -> dict:
    """One product module of each kind and shape a step runs: {name: (module, in_features)}."""
    found, shapes = {}, set()
    for name, m in [*model.layers[0].named_modules(prefix="layers.0"), ("output", model.output)]:
        k = in_features(m)
        if k is None:
            continue
        shape = (type(m), k, m.out_features)
        if shape not in shapes:
            shapes.add(shape)
            found[name] = (m, k)
    return found


def exact_verify_tokens(model, most=backend.LONGEST_VERIFY) -> tuple[int, str]:
    """The longest verify (tokens a row, 1 to `most`) whose every row equals, bit for bit, that row computed alone:
    one product of each kind and shape (products) and layer 0's attention over a cache of the model's whole context
    (where a split of the keys would show), on random inputs in the model's dtype. -> (rows, the first difference
    found, in words, or "")."""
    weight = model.tok_embeddings.weight
    g = torch.Generator(device=weight.device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=weight.device).to(weight.dtype)
    checks = {}
    for name, (m, k) in products(model).items():
        x = randn(1, most, k)
        checks[name] = lambda n, m=m, x=x: (m(x[:, :n]), torch.cat([m(x[:, i:i + 1]) for i in range(n)], 1))
    attention = model.layers[0].attention
    hd, kv, groups = model.args.head_dim, attention.n_kv_heads, attention.n_heads // attention.n_kv_heads
    context = max(model.args.max_seq_len, most)
    q, k, v = randn(1, kv, groups, most, hd), randn(1, kv, context, hd), randn(1, kv, context, hd)
    slots = torch.arange(context, device=weight.device)

    def attend(n, first):  # query rows first .. first + n - 1, the last `most` positions: [1, kv, groups, n, hd]
        positions = context - most + torch.arange(first, first + n, device=weight.device)
        mask = (slots <= positions[None, None, :, None]).repeat(1, 1, groups, 1)
        rows = q[:, :, :, first:first + n].reshape(1, kv, groups * n, hd)
        return attention.attend(rows, k, v, mask, positions[None]).view(1, kv, groups, n, hd)
    checks["layers.0.attention.attend"] = lambda n: (attend(n, 0), torch.cat([attend(1, i) for i in range(n)], 3))
    with torch.no_grad():
        for n in range(2, most + 1):
            for name, check in checks.items():
                together, alone = check(n)
                if not torch.equal(together, alone):
                    largest = (together.float() - alone.float()).abs().max().item()
                    return n - 1, f"{name} at {n} rows: largest difference {largest:.3g}"
    return most, ""


def try_to_serve(model) -> backend.Report:
    int4 = [(name, m) for name, m in model.named_modules() if type(m) is quantize.Int4Linear]
    if not int4:
        return backend.torch_report(model)
    reason = refusal(model, int4)
    if reason:
        backend.warn("CUDA", reason, RUNS_REFERENCE)
        return backend.torch_report(model, reason)
    g = torch.Generator(device=int4[0][1].weight.device).manual_seed(0)
    refused, total = [], len(int4)
    while int4:
        name, ref = int4.pop(0)
        fast = TinyGemmInt4Linear(ref)
        x = torch.randn(3, ref.in_features, generator=g, device=ref.weight.device, dtype=torch.bfloat16)
        with torch.no_grad():
            want, got = ref(x).float(), fast(x).float()
        error = ((got - want).norm() / want.norm()).item()
        if error <= TOLERANCE:
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, fast)
        else:
            refused.append(f"{name} ({error:.1e})")
        del ref, fast
    if refused:
        backend.warn("CUDA", f"{len(refused)} int4 layers on tinygemm are beyond {TOLERANCE} (relative RMS) from "
                     f"their reference forward: {', '.join(refused[:3])}", "those run the reference")
    if len(refused) == total:
        return backend.torch_report(model, "no int4 layer matched its reference on tinygemm")
    return backend.Report(name="cuda", serves=f"tinygemm: {total - len(refused)} int4 layers",
                          step_bytes=backend.step_bytes(model), held_bytes=backend.held_bytes(model),
                          fallback=f"{len(refused)} int4 layers run their reference" if refused else None)
