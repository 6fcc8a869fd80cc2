"""The CUDA backend, applied around model.py by loading.load_model (backend "auto" on a CUDA device), as tp.apply_tp
is. (Named gpu.py: a module named cuda would shadow NVIDIA's cuda package, which torch imports.) Results on
hardware: docs/cuda.md.

Exact speculation rests on a verify computing each of its K + 1 rows as a decode step computes its one row. cuBLAS
does not promise that (it picks kernels by shape), nor does PyTorch's own reduction for RMSNorm, so where Triton
imports, every product, attention and RMSNorm of a step runs on gpu_kernels.py's rows kernels: one tile shape and one
order over k for every row count, the weights decoded in registers (bf16 and int8 as the file has them; int4, int4k
and MX codes in 32-bit words laid out at load: gpu_kernels.layout). A verify's row is a decode's by construction. model.py's ops rms_norm and attention get those kernels as their CUDA
kernels (serve, for the process); each product module is replaced, by assignment, with a RowsLinear over the module's
own tensors. Each kernel is first checked against its reference (every row as it is alone; the ops at the model's
own shapes over its whole context, backend.check_op; each product kind on a few random rows within
backend.TOLERANCE); one that fails runs its reference, with one line saying why.

--backend aten: no Triton kernels; int4 layers run on aten's tinygemm kernel (Int4Linear's on-disk layout is
tinygemm's arithmetic, w = (q - 8) * scale + zero per group, so the codes are repacked once at load) and the rest on
their references, cuBLAS and SDPA inside the compiled step: to compare (scripts/gpu_check_more.sh).

exact_verify_tokens, the rows check on a model's every product shape and attention at 1 .. backend.LONGEST_VERIFY
rows, is what scripts/verify_rows.py and tests/test_cuda.py run on a GPU.
"""
import torch
import torch.nn as nn

import backend
import model as model_py
import mx
import quantize

served_ops = {}  # model.py's ops whose Triton kernel is registered: {op: the torch.library.Library that holds it}


class RowsLinear(nn.Module):
    """A product on gpu_kernels.rows_product: the reference module's own tensors (a bf16 weight, or a quantized
    file's codes and scales, laid out at load for wide loads and decoded in registers), its inputs rounded as its
    format rounds them."""

    def __init__(self, ref: nn.Module):
        super().__init__()
        import gpu_kernels
        fmt = quantize.format_of(ref)
        self.in_features, self.out_features, self.bias = ref.in_features, ref.weight.shape[0], ref.bias
        self.code, self.levels = fmt.code, fmt.levels
        self.bits, self.element = (fmt.element.bits, fmt.element.name) if fmt.element else (16, "")
        self.group = getattr(ref, "groupsize", 0)
        factors = quantize.factors_of(ref)
        weight, factors = gpu_kernels.layout(ref.weight.detach(), None if factors is None else factors.detach(),
                                             self.code, self.bits)
        self.register_buffer("weight", weight)
        self.register_buffer("factors", factors)

    def forward(self, x):
        rows = x if self.levels is None else quantize.round_activations(x, self.levels)
        y = torch.ops.fastdecode.rows_product(rows, self.weight, self.factors, self.code, self.bits, self.group,
                                              self.out_features, self.element)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def rows_attention(q, k, v, visible, scale):
    """model.attention's CUDA kernel: a step's rows on the Triton kernel, a prompt's on the reference's SDPA."""
    import gpu_kernels
    if visible.shape[1] <= backend.LONGEST_VERIFY and q.dtype in (torch.bfloat16, torch.float32):
        return gpu_kernels.rows_attention(q, k, v, visible, scale)
    return model_py.attention(q, k, v, visible, scale)


def rows_norm(x, weight, eps):
    """model.rms_norm's CUDA kernel, where x and the weight share a dtype (else the reference)."""
    import gpu_kernels
    if weight.dtype == x.dtype and x.shape[-1] <= 65536:
        return gpu_kernels.rows_norm(x, weight, eps)
    return model_py.rms_norm(x, weight, eps)


KERNELS = {"attention": rows_attention, "rms_norm": rows_norm}


def serve(op, on, device_type="CUDA"):
    """Register (or take back) the Triton kernel of model.py's op `op` at `device_type` (the tests' interpreter runs
    them on CPU tensors), and a fallthrough at its autograd key (no gradient is taken of a step)."""
    if not on:
        library = served_ops.pop(op, None)
        if library is not None:
            library._destroy()
        return
    if op not in served_ops:
        library = torch.library.Library("fastdecode", "IMPL")
        library.impl(op, KERNELS[op], device_type)
        library.impl(op, torch.library.fallthrough_kernel, f"Autograd{device_type}")
        served_ops[op] = library


def rows_refusal(transformer) -> str | None:
    """Why the Triton rows kernels cannot serve this model, or None."""
    try:
        import gpu_kernels  # noqa: F401 (registers the ops)
    except ImportError as e:
        return f"Triton is not importable ({e})"
    if transformer.tok_embeddings.weight.dtype not in (torch.bfloat16, torch.float32):
        return "they take bf16 or float32 models"
    head_dim = transformer.args.head_dim
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of 2 of at least 16"
    return None


def serve_rows(transformer, device_type="CUDA") -> tuple[int, list[str]]:
    """Serve model.py's ops on the Triton kernels and swap every product whose in_features the kernels take
    (multiples of 64, BLOCK_KS) for a RowsLinear, each kind spot-checked first. -> (products served, those refused with
    why)."""
    import gpu_kernels
    weight = transformer.tok_embeddings.weight
    g = torch.Generator(device=weight.device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=weight.device).to(weight.dtype)
    served, refused, verdicts = 0, [], {}
    for name, ref in [(n, m) for n, m in transformer.named_modules() if quantize.format_of(m) is not None]:
        if ref.in_features % gpu_kernels.BLOCK_KS[-1]:
            refused.append(f"{name} (in_features {ref.in_features})")
            continue
        kind = (type(ref), getattr(ref, "mode", None), ref.in_features, ref.out_features)
        if kind not in verdicts:
            fast, x = RowsLinear(ref), randn(1, 5, ref.in_features)
            verdicts[kind] = backend.spot_check(lambda a, b: fast(x[:, a:b]), lambda a, b: ref(x[:, a:b]))
        if verdicts[kind] is None:
            parent_name, _, child_name = name.rpartition(".")
            setattr(transformer.get_submodule(parent_name), child_name, RowsLinear(ref))
            served += 1
        else:
            refused.append(f"{name} ({verdicts[kind]})")
    for op, kernel in (("attention", gpu_kernels.rows_attention), ("rms_norm", gpu_kernels.rows_norm)):
        why = backend.check_op(transformer, op, kernel, exact_norm=False)
        if why is None:
            serve(op, True, device_type)
        else:
            refused.append(f"{op} ({why})")
    return served, refused


def exact_verify_tokens(model, most=backend.LONGEST_VERIFY) -> tuple[int, str]:
    """The longest verify (tokens a row, 1 to `most`) whose every row equals, bit for bit, that row computed alone:
    one product of each kind and shape and layer 0's attention over a cache of the model's whole context (where a
    split of the keys would show), on random inputs in the model's dtype. -> (rows, the first difference found, in
    words, or "")."""
    weight = model.tok_embeddings.weight
    g = torch.Generator(device=weight.device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=weight.device).to(weight.dtype)
    checks, shapes = {}, set()
    for name, m in [*model.layers[0].named_modules(prefix="layers.0"), ("output", model.output)]:
        if not hasattr(m, "out_features") or (type(m), m.in_features, m.out_features) in shapes:
            continue
        shapes.add((type(m), m.in_features, m.out_features))
        x = randn(1, most, m.in_features)
        checks[name] = lambda n, m=m, x=x: (m(x[:, :n]), torch.cat([m(x[:, i:i + 1]) for i in range(n)], 1))
    attention = model.layers[0].attention
    hd, kv, groups = model.args.head_dim, attention.n_kv_heads, attention.n_heads // attention.n_kv_heads
    context = max(model.args.max_seq_len, most)
    q, k, v = randn(1, kv, groups, most, hd), randn(1, kv, context, hd), randn(1, kv, context, hd)

    def attend(n, first):  # query rows first .. first + n - 1, the last `most` positions: [1, kv, groups, n, hd]
        positions = context - most + torch.arange(first, first + n, device=weight.device)
        rows = q[:, :, :, first:first + n].reshape(1, kv, groups * n, hd)
        visible = model_py.visible_slots(positions[None], context)
        return attention.attend(rows, k, v, visible).view(1, kv, groups, n, hd)
    checks["layers.0.attention.attend"] = lambda n: (attend(n, 0), torch.cat([attend(1, i) for i in range(n)], 3))
    with torch.no_grad():
        for n in range(2, most + 1):
            for name, check in checks.items():
                together, alone = check(n)
                if not torch.equal(together, alone):
                    largest = (together.float() - alone.float()).abs().max().item()
                    return n - 1, f"{name} at {n} rows: largest difference {largest:.3g}"
    return most, ""


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


def apply(model, backend_name="auto") -> backend.Report:
    """Serve a CUDA model on the Triton rows kernels (serve_rows), or with --backend aten (or without Triton) its int4
    layers on tinygemm (tinygemm): the reference serves whatever cannot run or does not match, with one warning
    line."""
    why = "--backend aten" if backend_name == "aten" else rows_refusal(model)
    if why is None:
        served, refused = serve_rows(model)
        if refused:
            backend.warn("CUDA", f"{len(refused)} kernels refused: {', '.join(refused[:3])}",
                         "those run model.py's reference; the rest the Triton rows kernels")
        report = backend.Report(name="cuda", serves=f"Triton rows kernels: {served} products, "
                                                    f"{' and '.join(served_ops) or 'no op'}",
                                step_bytes=backend.step_bytes(model), held_bytes=backend.held_bytes(model),
                                max_verify_tokens=backend.LONGEST_VERIFY,
                                fallback="; ".join(refused) if refused else None)
    else:
        report = tinygemm(model, why)
    return backend.attach(model, report)


def tinygemm(model, why) -> backend.Report:
    int4 = [(name, m) for name, m in model.named_modules() if type(m) is quantize.Int4Linear]
    if not int4:
        return backend.torch_report(model, why)
    reason = refusal(model, int4)
    if reason:
        backend.warn("CUDA", reason, "int4 layers run quantize.py's reference forward")
        return backend.torch_report(model, reason)
    g = torch.Generator(device=int4[0][1].weight.device).manual_seed(0)
    refused, total = [], len(int4)
    while int4:
        name, ref = int4.pop(0)
        fast = TinyGemmInt4Linear(ref)
        x = torch.randn(3, ref.in_features, generator=g, device=ref.weight.device, dtype=torch.bfloat16)
        with torch.no_grad():
            error = backend.relative_error(ref(x), fast(x))
        if error <= backend.TOLERANCE:
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, fast)
        else:
            refused.append(f"{name} ({error:.1e})")
        del ref, fast
    if refused:
        backend.warn("CUDA", f"{len(refused)} int4 layers on tinygemm are beyond {backend.TOLERANCE} (relative RMS) from "
                     f"their reference forward: {', '.join(refused[:3])}", "those run the reference")
    if len(refused) == total:
        return backend.torch_report(model, "no int4 layer matched its reference on tinygemm")
    return backend.Report(name="cuda", serves=f"tinygemm: {total - len(refused)} int4 layers ({why})",
                          step_bytes=backend.step_bytes(model), held_bytes=backend.held_bytes(model),
                          fallback=f"{len(refused)} int4 layers run their reference" if refused else None)
