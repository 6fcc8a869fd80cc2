"""Each format's products at a model's shapes on the kernels its device serves, a line as each cell finishes: the
first part of scripts/gpu_check.sh (~30 s at the 7B's shapes on an H100), so that a GPU run returns numbers before
anything compiles.

    python scripts/bench_products.py scripts/configs/llama-2-7b.json [--rows 1,8,17] [--modes bf16,int8,...]

One layer's products as model.py stacks them (wqkv, wo, w13, w2) with random weights, quantized by quantize.py: on
CUDA on the Triton rows kernels (gpu.RowsLinear), beside torch.mm on the bf16 weights and aten's tinygemm int4
(_weight_int4pack_mm, groups of 32); elsewhere on the CPU backend (cpu.Linear). Per format and rows: the median time of
the four products (CUDA events on a GPU), the weight bytes over it (GB/s) and that time in torch.mm's at 1 row.
`--device cpu --triton` runs the Triton kernels on CPU tensors (TRITON_INTERPRET=1, toy shapes: how the tests run it).
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quantize  # noqa: E402
from checkpoint import InputError, OneLineErrors, read_model_args  # noqa: E402
from loading import check_device  # noqa: E402


def layer_shapes(args) -> dict:
    """{product: (in_features, out_features)} of one layer, as model.py stacks them."""
    hd = args.head_dim
    return {"wqkv": (args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd), "wo": (args.n_heads * hd, args.dim),
            "w13": (args.dim, 2 * args.intermediate_size), "w2": (args.intermediate_size, args.dim)}


def products(shapes, mode, device, triton):
    """The layer's products in `mode` (None: bf16 weights) as its device serves them: {name: (module, bytes)}."""
    out = {}
    g = torch.Generator(device).manual_seed(0)
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, generator=g, device=device).mul_(0.02)
        if mode is None:
            reference = w.bfloat16()
            tensors = [reference]
        else:
            with torch.device("meta"):
                reference = quantize.quantized_linear(mode, nn.Linear(k, n, bias=False), 32, name)
            reference.load_state_dict(quantize.quantize_tensor(mode, w, 32), assign=True)
            tensors = [t for t in reference.state_dict().values()]
        out[name] = (served(reference, mode, device, triton), sum(t.numel() * t.element_size() for t in tensors))
    return out


def served(reference, mode, device, triton):
    """A product's forward as the backend of `device` runs it (triton: the Triton rows kernels, on any device)."""
    if mode is None and not triton and torch.device(device).type == "cuda":
        return lambda x: F.linear(x, reference)
    if triton or torch.device(device).type == "cuda":
        import gpu
        import gpu_kernels
        if mode is None:
            return lambda x: gpu_kernels.rows_product(x, reference)
        return gpu.RowsLinear(reference)
    import cpu
    from cpu import kernels
    if not kernels.load():
        raise InputError("few_rows.cpp did not build: no CPU kernels to measure")
    if mode is None:
        linear = nn.Linear(reference.shape[1], reference.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data = reference
        reference = linear
    return cpu.Linear(reference, quantize.format_of(reference))


def timed(fns, x, repeats, device) -> float:
    """The median ms of one call of every fn in turn, after a warm-up."""
    cuda = torch.device(device).type == "cuda"
    with torch.no_grad():
        for fn in fns:
            fn(x[fn])
        times = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            for fn in fns:
                fn(x[fn])
            if cuda:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tinygemm(shapes, device):
    """aten's int4 kernel on the layer (groups of 32), or None where it does not run (not CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    import gpu
    out = {}
    g = torch.Generator(device).manual_seed(0)
    for name, (k, n) in shapes.items():
        with torch.device("meta"):
            reference = quantize.quantized_linear("int4", nn.Linear(k, n, bias=False), 32, name)
        reference.load_state_dict(quantize.quantize_tensor("int4", torch.randn(n, k, generator=g, device=device)
                                                           .mul_(0.02), 32), assign=True)
        module = gpu.TinyGemmInt4Linear(reference)
        out[name] = (module, sum(t.numel() * t.element_size() for t in module.state_dict().values()))
    return out


def run(opts):
    check_device(opts.device)
    args = read_model_args(opts.config)
    shapes = layer_shapes(args)
    rows = [int(r) for r in opts.rows.split(",")]
    modes = opts.modes.split(",")
    for mode in modes:
        if mode != "bf16" and mode not in quantize.MODES:
            raise InputError(f"--modes {mode}: unknown; use bf16 or one of {', '.join(quantize.MODES)}")
    device = torch.device(opts.device)
    print(f"# one layer of {opts.config} ({', '.join(f'{name} {k}x{n}' for name, (k, n) in shapes.items())}), "
          f"{device}, median of {opts.repeats}; ms for the four products, GB/s of their weights", flush=True)
    baseline = None
    cells = [("torch.mm bf16", None, False)] if device.type == "cuda" else []
    cells += [(mode, None if mode == "bf16" else mode, True) for mode in modes]
    cells += [("tinygemm int4", "tinygemm", False)] if device.type == "cuda" else []
    for label, mode, ours in cells:
        layer = tinygemm(shapes, device) if mode == "tinygemm" else products(shapes, mode, device,
                                                                               opts.triton and ours)
        weight_bytes = sum(b for _, b in layer.values())
        for r in rows:
            x = {fn: torch.randn(1, r, shapes[name][0], device=device).bfloat16() for name, (fn, _) in layer.items()}
            ms = timed([fn for fn, _ in layer.values()], x, opts.repeats, device)
            baseline = baseline or ms
            print(f"{label:>14} {r:>2} rows: {ms:8.3f} ms {weight_bytes / ms / 1e6:7.1f} GB/s  "
                  f"{ms / baseline:5.2f}x the first cell's time", flush=True)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config.json (scripts/configs/ has the 7B's shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="1,8,17", help="tokens a step: a decode, a verify of K = 7, the longest")
    parser.add_argument("--modes", default="bf16,int8,int4,int4k,mxfp6,mxfp4")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--triton", action="store_true", help="the Triton rows kernels on a CPU device too "
                        "(set TRITON_INTERPRET=1 first)")
    cli.run(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
