"""The CPU backend: few_rows.cpp's kernels for model.py's ops and for every weight format's product.

    apply(model)  # loading.load_model does this on CPU with --backend auto (the default), after the model's
                  # final dtype and device

It builds the kernels for this CPU (kernels.py: once per source, flags, torch and CPU), then holds each kernel this
model needs to its reference: model.py's ops at the model's own shapes over its whole context (backend.check_op),
each product's format on a few random rows (spot_check); under a second, and the tests hold every kernel to its
reference at every row count. Those that pass serve: model.py's rms_norm and attention ops get their CPU kernel, for
the process (serve), and each product module of a format that passed is replaced, by assignment, with a `Linear`
holding its weight in this CPU's layout (few_rows::layout, from the file's tensors), whose forward is one call. What
does not pass runs its reference, with one line saying why. The model's forward stays model.py's, eager or compiled:
a fork's edit is Python that runs as written around the same ops.
"""
import contextlib
import sys
import time
from collections import Counter

import torch
import torch.nn as nn

import backend
import mx
import quantize
from checkpoint import release_file_pages
from cpu import kernels
from cpu.huge_pages import HugePages, give_back_heap

__all__ = ["apply", "references"]

OPS = ("rms_norm", "attention")  # model.py's ops that few_rows.cpp has kernels for
served_ops = set()  # those whose kernel is registered in this process (serve)
checks = {}  # spot_check's verdicts, once per process: {kernel: None where it serves, else why not}


def warn(message, runs="the model runs on model.py's PyTorch path"):
    backend.warn("CPU", message, runs)


class Linear(nn.Module):
    """A product on few_rows.cpp: the weight of a format's module (quantize.Format) laid out for this CPU at load
    (column tiles, 16 outputs in a vector's lanes: bf16 in pairs, integer codes as exact integer sums), any number of
    rows, each row computed as it would be alone."""

    def __init__(self, module: nn.Module, fmt: quantize.Format, layout=-1):
        """layout: one of few_rows's layouts (cpu/few_rows/linear.h), or -1 for this CPU's choice."""
        super().__init__()
        # (its weight's rows: a tied head split by tensor parallelism keeps nn.Linear's out_features of the whole)
        self.in_features, self.out_features, self.mode = module.in_features, module.weight.shape[0], fmt.mode
        factors = quantize.factors_of(module)
        values, bits, multiple = None, 0, 0
        if fmt.element is not None:  # the values of its element codes, as mx.py defines them
            bits, multiple = fmt.element.bits, fmt.element.integer_multiple or 0
            values = mx.decode_elements(torch.arange(1 << bits, dtype=torch.int32).to(torch.uint8), fmt.element)
        layout, weight, factors, table = torch.ops.few_rows.layout(
            fmt.code, module.weight.detach(), None if factors is None else factors.detach(), values, bits, multiple,
            layout)
        self.layout = layout
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("factors", factors, persistent=False)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("bias", None if module.bias is None else module.bias.detach().float(), persistent=False)

    def forward(self, x):
        return torch.ops.few_rows.linear(x, self.layout, self.weight, self.factors, self.table, self.bias,
                                         self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}, layout {self.layout}"


def serve(op: str, on: bool):
    """Register (or take back) few_rows.cpp's kernel as the CPU kernel of model.py's op `op`, for the process."""
    torch.ops.few_rows.serve(op, on)
    (served_ops.add if on else served_ops.discard)(op)


@contextlib.contextmanager
def references():
    """model.py's ops run their references (PyTorch) inside the block, whatever the backend registered."""
    held = set(served_ops)
    for op in held:
        serve(op, False)
    try:
        yield
    finally:
        for op in held:
            serve(op, True)


def product_kernel(module) -> tuple:
    """What names a product's kernel and layout for the spot check: its format, dtype, group, whether its inputs fill
    blocks of 32."""
    fmt = quantize.format_of(module)
    return ("product", fmt.mode, module.weight.dtype if fmt.code == quantize.PLAIN else None,
            getattr(module, "groupsize", None), module.in_features % 32 == 0)


def random_product(kernel, dtype):
    """A small product module of a kernel's format with random weights (in_features a multiple of 32 or not, as the
    kernel's), and its reference: itself."""
    _, mode, weight_dtype, groupsize, blocks = kernel
    g = torch.Generator().manual_seed(0)
    k, n = (max(64, 2 * (groupsize or 0)) if blocks else 48), 48
    w = torch.randn(n, k, generator=g) / k ** 0.5
    bias = torch.randn(n, generator=g).to(dtype)
    if mode == "plain":
        module = nn.Linear(k, n).to(weight_dtype)
        module.weight.data.copy_(w), module.bias.data.copy_(bias)
        return module
    with torch.device("meta"):
        module = quantize.quantized_linear(mode, nn.Linear(k, n, bias=True), groupsize or 32)
    module.load_state_dict(dict(quantize.quantize_tensor(mode, w, groupsize or 32), bias=bias), assign=True)
    return module


def spot_check(kernel, dtype) -> str | None:
    """A product's kernel this CPU runs against its reference on a few random rows: every row as it is alone, bit for
    bit, and within backend.TOLERANCE of the reference. -> None where it serves, else why not. Once per process and
    kernel."""
    if (kernel, dtype) in checks:
        return checks[kernel, dtype]
    g = torch.Generator().manual_seed(1)
    n = 5  # rows: a verify of K = 4
    try:
        reference = random_product(kernel, dtype)
        served, x = Linear(reference, quantize.format_of(reference)), torch.randn(1, n, reference.in_features,
                                                                                   generator=g).to(dtype)
        verdict = backend.spot_check(lambda a, b: served(x[:, a:b]), lambda a, b: reference(x[:, a:b]), n)
    except Exception as e:  # noqa: BLE001 (a kernel that refuses what it was given, whatever it raises)
        verdict = backend.refusal(e)
    checks[kernel, dtype] = verdict
    return verdict


def op_check(transformer, op) -> str | None:
    """few_rows.cpp's kernel of model.py's op held to the op's reference at this model's own shapes
    (backend.check_op). Once per process and shapes."""
    key = backend.op_key(transformer, op)
    if key not in checks:
        checks[key] = backend.check_op(transformer, op, getattr(torch.ops.few_rows, op))
    return checks[key]


def apply(transformer, mapped=None, phases=None) -> backend.Report:
    """Serve a loaded model on CPU with few_rows.cpp where its kernels pass their spot check; its report (model.py's
    own where nothing serves, with one warning line for each kernel refused). `mapped`: the model's tensors as mapped
    from its file, whose pages each layer gives back once its weights are laid out. `phases`: a dict that gets the
    seconds each part took."""
    phases = {} if phases is None else phases
    return backend.attach(transformer, try_to_serve(transformer, phases, mapped or {}))


def try_to_serve(transformer, phases, mapped) -> backend.Report:
    dtype = transformer.tok_embeddings.weight.dtype
    if transformer.tok_embeddings.weight.device.type != "cpu":
        return backend.torch_report(transformer)
    if dtype == torch.float16:
        reason = "none of its kernels takes fp16, and PyTorch's fp16 products on a CPU are slow (SmolLM2: 3 tok/s)"
        warn(reason + "; --dtype bf16 (the default) or fp32 are served")
        return backend.torch_report(transformer, reason)
    start = time.perf_counter()
    if not kernels.load():
        return backend.torch_report(transformer, "few_rows.cpp did not build")
    phases["kernels"] = time.perf_counter() - start
    start = time.perf_counter()
    products = {name: m for name, m in transformer.named_modules() if quantize.format_of(m) is not None}
    refused = {}  # kernel: why
    for op in OPS:
        why = op_check(transformer, op)
        serve(op, why is None)  # (refused for one model, the op runs its reference for every model in the process)
        if why is not None:
            refused[f"model.py's {op}"] = why
    for kernel in sorted({product_kernel(m) for m in products.values()}, key=str):
        why = spot_check(kernel, dtype)
        if why is not None:
            refused[f"{kernel[1]} products"] = why
    phases["check"] = time.perf_counter() - start
    for what, why in refused.items():
        warn(f"{what}: {why}", f"{what} run model.py's reference")
    start = time.perf_counter()
    served = serve_products(transformer, products, mapped, refused)
    phases["serve"] = time.perf_counter() - start
    if not served and not served_ops:
        return backend.torch_report(transformer, "; ".join(refused.values()))
    paths = torch.ops.few_rows.paths()
    products = ", ".join(f"{n} {mode} in {paths[layout]}" for (mode, layout), n in
                         sorted(Counter((m.mode, m.layout) for m in served).items()))
    ops = [op for op in OPS if op in served_ops]
    return backend.Report(
        name="cpu", serves=f"few_rows.cpp: {len(served)} products ({products}), {' and '.join(ops) or 'no op'}; "
                           f"{amx_note()}",
        sizes_threads=True,  # each output is summed by one thread: the results do not depend on the thread count
        step_bytes=backend.step_bytes(transformer), held_bytes=backend.held_bytes(transformer),
        max_verify_tokens=backend.LONGEST_VERIFY,
        fallback="; ".join(f"{what}: {why}" for what, why in refused.items()) or None)


def amx_note() -> str:
    """Whether the integer products of 2+ rows run on AMX tiles, or why not, in a few words (cpu/few_rows/amx.h)."""
    if "amx_tile" not in kernels.cpu_features():
        return "no AMX tiles on this CPU"
    return torch.ops.few_rows.amx("")


def serve_products(transformer, products, mapped, refused) -> list[Linear]:
    """Replace every product whose kernel passed with a Linear of this CPU's layout, layer by layer: their weights in
    huge pages, each layer's file pages given back once laid out. -> the Linears"""
    pages, served = HugePages(), []
    tied = transformer.args.tie_embeddings
    for prefix, part in [(f"layers.{i}.", layer) for i, layer in enumerate(transformer.layers)] + [("", None)]:
        names = [n for n in products if n.startswith(prefix)] if part is not None else ["output"]
        for name in names:
            module = products.pop(name, None)
            kernel = None if module is None else product_kernel(module)
            if module is None or f"{kernel[1]} products" in refused:
                continue
            linear = Linear(module, quantize.format_of(module))
            for buffer in ("weight", "factors"):  # what a step streams, in 2 MiB pages (docs/how-it-works.md)
                t = getattr(linear, buffer)
                if t is not None:
                    setattr(linear, buffer, pages.empty(t.shape, t.dtype).copy_(t))
            parent, _, child = name.rpartition(".")
            setattr(transformer.get_submodule(parent), child, linear)
            served.append(linear)
        release_file_pages(t for n, t in mapped.items() if n.startswith(prefix or "output.")
                           or (tied and not prefix and n == "tok_embeddings.weight"))
        give_back_heap()
    return served
