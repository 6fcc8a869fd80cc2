"""few_rows.cpp: built for this CPU at first use, cached under a name made from its source, and its ops."""
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("few_rows.cpp")
# A step: decode (1 token a row), draft catch-up (2) or verify (K + 1, K <= speculative.MAX_SPECULATE_K).
# few_rows.cpp computes each row of a step by itself, whatever the number of rows, so a verify's rows are bit for
# bit a decode step's and speculation stays exact in bf16 (a verify of 17 rows once took PyTorch's GEMM, which
# rounds otherwise, and K = 16 changed the text).
STEP_TOKENS = 33
loaded = None  # whether the ops are loaded; None: not tried yet


def cpu_features() -> str:
    """What -march=native compiles for: this CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()


def build_name(source: str, march: str) -> str:
    """The build's name, a hash of what made it (source, flags, torch, CPU features): a build from other sources
    is never loaded, and two checkouts or versions of this project on one machine keep a build each instead of
    rebuilding each other's under one name."""
    made_of = "\0".join([source, march, torch.__version__, sys.version, cpu_features() if march == "native" else ""])
    return "few_rows_" + hashlib.sha256(made_of.encode()).hexdigest()[:16]


def build(march: str = "native"):
    """Build few_rows.cpp for `march` (once per source: torch caches it under TORCH_EXTENSIONS_DIR, by default
    ~/.cache/torch_extensions) and load its ops; the first build says so on stderr, with the time it took."""
    from torch.utils.cpp_extension import get_default_build_root, load
    name = build_name(SOURCE.read_text(), march)
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not (directory / f"{name}.so").is_file()
    if fresh:
        print(f"building few_rows.cpp for this CPU (-march={march}, once per source)...", end="", file=sys.stderr,
              flush=True)
    start = time.perf_counter()
    try:
        load(name=name, sources=[str(SOURCE)], build_directory=str(directory), is_python_module=False,
             extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except BaseException:
        if fresh:
            print(" failed", file=sys.stderr)
        raise
    if fresh:
        print(f" done in {time.perf_counter() - start:.0f} s, cached in {directory}", file=sys.stderr)


def load() -> bool:
    """The ops built for this CPU, once per process; False (with one warning) where they do not build (no C++
    compiler): the model then runs on PyTorch's kernels alone."""
    global loaded
    if loaded is not None:
        return loaded
    try:
        build()
    except Exception as error:  # no compiler, no ninja, unknown flags: run without, and say so once
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
        print(f"warning: few_rows.cpp did not build ({reason[:200]}); the CPU backend is off, the model runs on "
              "PyTorch's kernels", file=sys.stderr)
        loaded = False
        return False
    # Shapes for torch.compile, which traces without running the kernels.
    def rows_by_outputs(x, weight, factors=None, table=None):
        return x.new_empty(x.shape[0], weight.shape[0])
    torch.library.register_fake("few_rows::product")(rows_by_outputs)
    torch.library.register_fake("few_rows::attention")(lambda q, k, v, positions: torch.empty_like(q))
    torch.library.register_fake("few_rows::llama_step")(
        lambda tokens, positions, embeddings, *rest: embeddings.new_empty(*tokens.shape, rest[3][-1].shape[0]))
    loaded = True
    return True


def step_rows(x) -> bool:
    """Whether x [..., T, K] holds the rows of a step (T <= STEP_TOKENS), which few_rows.cpp computes one by one."""
    return x.dim() >= 2 and x.shape[-2] <= STEP_TOKENS


def product(x, weight, factors=None, table=None):
    """x [..., K] @ (weight [N, K] x factors).T in float32; factors: [N] or [N, K / block]. With a table
    (packed MX 6-bit codes): weight holds the codes of the table's values, factors their E8M0 scales."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.few_rows.product(rows, weight, factors, table).view(*x.shape[:-1], weight.shape[0])


# Without native bf16 (AVX2), the CPU runs a 16-bit GEMM ~5-6x slower than a float32 one, conversions included:
# 130 x 576 @ 576 x 1728 in bf16 13.1 ms, fp16 11.1, float32 1.9-2.2. A 125-token bf16 SmolLM2 prefill took 1.4 s.
GEMM_IN_FLOAT32 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def many_rows(x, weight, bias=None):
    """F.linear for a prompt's rows, in x's dtype: where the CPU lacks native bf16, float32 rounded once."""
    if x.dtype in (torch.bfloat16, torch.float16) and GEMM_IN_FLOAT32:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
