"""The CUDA backend, applied around model.py by loading.load_model (backend "auto" on a CUDA device), as tp.apply_tp
is. (Named gpu.py: a module named cuda would shadow NVIDIA's cuda package, which torch imports.) Results on
hardware: docs/cuda.md.

Exact speculation rests on a verify computing each of its K + 1 rows as a decode step computes its one row. cuBLAS
does not promise that (it picks kernels by shape), so where Triton imports, every product and attention of a step
runs on gpu_kernels.py's rows kernels, one tile shape and one order over k for every row count, the weights decoded
in registers from their file's layout (bf16, int8, int4, MX): a verify's row is a decode's by construction. Each
module is checked against its reference forward (model.py's, quantize.py's) on random inputs before it serves
(serve_rows); what does not match, or does not fit, stays on aten with one warning line. They are custom ops with
fake implementations (torch.library), so the compiled steps with CUDA graphs call them as they are.
FASTDECODE_CUDA_KERNELS=aten turns them off (to compare; scripts/gpu_check_more.sh).

Without Triton (or with them off), int4 layers run on aten's tinygemm kernel: Int4Linear's on-disk layout is
tinygemm's arithmetic, w = (q - 8) * scale + zero per group with scales_and_zeros [K/g, N, 2], so the codes are
repacked once at load (_convert_weight_to_int4pack) and multiplied by _weight_int4pack_mm on inputs rounded as the
reference rounds them; int8 and MX layers run their reference forwards inside the compiled step.

Either way, before the model serves, exact_verify_tokens runs one product of each shape and the attention at 1 and up
to backend.LONGEST_VERIFY rows, bit for bit, and the report says the longest verify that held
(backend.Report.max_verify_tokens). The target's steps are compiled without coordinate-descent tuning
(speculative.compile_options), which would rewrite one-row aten products only.
"""
import dataclasses
import os

import torch
import torch.nn as nn

import backend
import model
import mx
import quantize

TOLERANCE = 0.01  # relative RMS against the reference forward, in bf16
RUNS_REFERENCE = "int4 layers run quantize.py's reference forward"


class RowsLinear(nn.Module):
    """A product on gpu_kernels.rows_product: the reference module's own tensors (a bf16 weight, or a quantized
    file's codes and scales, decoded in registers), its inputs rounded as its reference forward rounds them."""

    def __init__(self, ref: nn.Module):
        super().__init__()
        import gpu_kernels as kernels
        self.in_features, self.out_features, self.bias = ref.in_features, ref.out_features, ref.bias
        self.fmt, self.bits, self.group, self.element, self.levels = kernels.BF16, 16, 0, "", None
        factors = None
        if isinstance(ref, quantize.Int8Linear):
            self.fmt, self.levels, factors = kernels.INT8, quantize.WIDE, ref.scales
        elif isinstance(ref, quantize.Int4Linear):
            self.fmt, self.levels, self.group, factors = kernels.INT4, 127, ref.groupsize, ref.scales_and_zeros
        elif isinstance(ref, quantize.MXLinear):
            self.fmt, self.bits, self.element, factors = kernels.MX, ref.fmt.bits, ref.fmt.name, ref.scales
            self.levels = quantize.WIDE if ref.fmt.integer_multiple else None
        self.register_buffer("weight", ref.weight.detach())
        self.register_buffer("factors", None if factors is None else factors.detach())

    def forward(self, x):
        rows = x if self.levels is None else quantize.round_activations(x, self.levels)
        y = torch.ops.fastdecode.rows_product(rows, self.weight, self.factors, self.fmt, self.bits, self.group,
                                              self.out_features, self.element)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class RowsAttention(model.Attention):
    """A step's query rows attend the cache on gpu_kernels.rows_attention, each row alone (a verify attends as decode
    would); a prompt's rows take model.py's SDPA."""

    def attend(self, q, k, v, mask, input_pos):
        if input_pos.shape[-1] <= backend.LONGEST_VERIFY:
            return torch.ops.fastdecode.rows_attention(q, k, v, input_pos)
        return super().attend(q, k, v, mask, input_pos)


def rows_refusal(transformer) -> str | None:
    """Why the Triton rows kernels cannot serve this model, or None."""
    try:
        import gpu_kernels  # noqa: F401 (registers the ops)
    except ImportError as e:
        return f"Triton is not importable ({e})"
    if os.environ.get("FASTDECODE_CUDA_KERNELS") == "aten":
        return "FASTDECODE_CUDA_KERNELS=aten"
    if transformer.tok_embeddings.weight.dtype not in (torch.bfloat16, torch.float32):
        return "they take bf16 or float32 models"
    head_dim = transformer.args.head_dim
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of 2 of at least 16"
    return None


def serve_rows(transformer) -> tuple[int, list[str]]:
    """Swap every product whose in_features the kernels take (multiples of BLOCK_K) for a RowsLinear and every
    attention for a RowsAttention, each checked first against its reference (model.py's, quantize.py's) on random
    inputs, within TOLERANCE. -> (products served, those refused with their error)."""
    import gpu_kernels
    weight = transformer.tok_embeddings.weight
    g = torch.Generator(device=weight.device).manual_seed(0)
    served, refused = 0, []
    kinds = (nn.Linear, *quantize.FORMATS.values())
    for name, ref in [(n, m) for n, m in transformer.named_modules() if type(m) in kinds]:
        if ref.in_features % gpu_kernels.BLOCK_K:
            refused.append(f"{name} (in_features {ref.in_features})")
            continue
        fast = RowsLinear(ref)
        x = torch.randn(3, ref.in_features, generator=g, device=weight.device).to(weight.dtype)
        with torch.no_grad():
            error = relative_error(ref(x), fast(x))
        if error <= TOLERANCE:
            parent_name, _, child_name = name.rpartition(".")
            setattr(transformer.get_submodule(parent_name), child_name, fast)
            served += 1
        else:
            refused.append(f"{name} ({error:.1e})")
    attention = transformer.layers[0].attention
    hd, kv, groups = transformer.args.head_dim, attention.n_kv_heads, attention.n_heads // attention.n_kv_heads
    q, k, v = (torch.randn(1, kv, n, hd, generator=g, device=weight.device).to(weight.dtype)
               for n in (groups * 3, 40, 40))
    positions = torch.tensor([[20, 21, 22]], device=weight.device)
    mask = (torch.arange(40, device=weight.device) <= positions[:, None, :, None]).repeat(1, 1, groups, 1)
    with torch.no_grad():
        error = relative_error(model.Attention.attend(attention, q, k, v, mask, positions),
                               torch.ops.fastdecode.rows_attention(q, k, v, positions))
    if error <= TOLERANCE and type(attention) is model.Attention:
        for layer in transformer.layers:
            layer.attention.__class__ = RowsAttention
    else:
        refused.append(f"attention ({error:.1e})")
    return served, refused


def relative_error(want, got) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


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
    """Serve a CUDA model's products and attention on the Triton rows kernels (serve_rows), or without them its int4
    layers on tinygemm (try_to_serve): each module checked against its reference forward on random inputs before it
    replaces it (the reference is dropped as it goes: no second copy of the model at the peak); where one cannot run
    or does not match, the reference serves, with one warning line. Then the rows check (exact_verify_tokens) sets
    the longest verify it serves exactly."""
    served, refused = serve_rows(model) if rows_refusal(model) is None else (0, [])
    if served:
        if refused:
            backend.warn("CUDA", f"{len(refused)} products or attention stay on aten: {', '.join(refused[:3])}",
                         "the rest run on the Triton rows kernels")
        report = backend.Report(name="cuda", serves=f"Triton rows kernels: {served} products"
                                + ("" if any(r.startswith("attention") for r in refused) else " and attention"),
                                step_bytes=backend.step_bytes(model), held_bytes=backend.held_bytes(model),
                                fallback=f"{len(refused)} on aten" if refused else None)
    else:
        report = try_to_serve(model)
    rows, difference = exact_verify_tokens(model)
    if rows < 2:
        backend.warn("CUDA", f"a verify does not compute its rows as a decode step does ({difference})",
                     "speculation runs, its output plain decoding's except where two logits are that close")
        return backend.attach(model, report)
    return backend.attach(model, dataclasses.replace(report, max_verify_tokens=rows))


def in_features(m) -> int | None:
    """A product module's inputs (None: not a product)."""
    return m.in_features if isinstance(m, (nn.Linear, RowsLinear, TinyGemmInt4Linear, *quantize.FORMATS.values())) \
        else None


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
