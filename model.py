"""Llama-family and CodeGen transformers with a static KV cache.

One forward serves every use: `forward(tokens [B, T], input_pos [B, T])`, with T = 1 (decode), K + 1
(speculative verify) or a whole prompt (prefill). Each batch row carries its own positions; the attention
mask is derived from them, so stale cache slots (padding, rejected draft tokens) are never attended and
are simply overwritten later.

Rotary embeddings use one convention (the first and second half of the rotated dims form the pairs).
Checkpoints stored in the interleaved convention (GGUF, CodeGen) are permuted once at conversion; attention
scores are unchanged by a permutation applied to both q and k.
"""
import json
import math
import mmap
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class InputError(Exception):
    """Bad input from the user (file, field, flag): reported as one line, without a traceback."""


def read_config(path) -> dict:
    """config.json as a dict, or one InputError naming the file: missing, not JSON, or not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: not found; convert the model with scripts/convert_checkpoint.py")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); re-run scripts/convert_checkpoint.py") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: not a JSON object but {type(config).__name__}; re-run "
                         "scripts/convert_checkpoint.py")
    return config


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class ModelArgs:
    """The model's shape and math. config.json must name every field except the last three below, whose absence
    means their neutral value (no rope scaling, the whole head rotates, no q/k/v bias)."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    # "llama": RMSNorm, sequential residual, SwiGLU.  "codegen": LayerNorm, attention and MLP in parallel on
    # one normed input, GELU MLP, biases, LM head with bias.
    family: str = "llama"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # the model's context length
    rope_scaling: dict | None = None  # Llama-3 style: factor, low/high_freq_factor, original_max_position_embeddings
    rotary_dim: int | None = None  # None: the whole head dim rotates
    qkv_bias: bool = False

    OPTIONAL = ("rope_scaling", "rotary_dim", "qkv_bias")
    LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

    def __post_init__(self):
        def bad(name, want):
            value = getattr(self, name)
            return InputError(f"config.json: field '{name}' must be {want}, not {value!r}; fix the file or re-run "
                              "scripts/convert_checkpoint.py")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "a positive integer")
        if not is_number(self.norm_eps) or self.norm_eps < 0:
            raise bad("norm_eps", "a finite number >= 0")
        if not is_number(self.rope_theta) or self.rope_theta <= 0:
            raise bad("rope_theta", "a finite number > 0")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if self.family not in ("llama", "codegen"):
            raise InputError(f"config.json: family '{self.family}' is not supported; use 'llama' or 'codegen'")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise InputError(f"config.json: dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {self.n_kv_heads} "
                             "are inconsistent (dim % n_heads and n_heads % n_kv_heads must be 0)")
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if (not isinstance(self.rotary_dim, int) or isinstance(self.rotary_dim, bool) or self.rotary_dim < 2
                or self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise InputError(f"config.json: rotary_dim {self.rotary_dim!r} must be even and <= head dim "
                             f"{self.head_dim}")
        scaling = self.rope_scaling
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
            if not isinstance(scaling, dict) or kind not in (None, "default", "llama3"):
                raise InputError(f"config.json: rope_scaling {scaling!r} is not supported (only 'llama3')")
            if kind == "llama3" and not all(is_number(scaling.get(key)) and scaling[key] > 0
                                            for key in self.LLAMA3_SCALING):
                raise InputError(f"config.json: rope_scaling of type llama3 needs positive numbers "
                                 f"{', '.join(self.LLAMA3_SCALING)}; got {scaling!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, path) -> "ModelArgs":
        path = Path(path)
        config = read_config(path)
        known = [f.name for f in fields(cls)]
        missing = [name for name in known if name not in cls.OPTIONAL and name not in config]
        if missing:
            raise InputError(f"{path}: missing field '{missing[0]}'; re-run scripts/convert_checkpoint.py")
        try:
            return cls(**{k: v for k, v in config.items() if k in known})
        except InputError as e:  # name the file, not just "config.json"
            raise InputError(str(e).replace("config.json", str(path), 1)) from None


class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, n_kv_heads, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        # k, v: [B, T, H_kv, D]; row b writes its T entries at its own positions input_pos[b].
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        return self.k_cache, self.v_cache


def rope_frequencies(args: ModelArgs, device) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], with Llama-3 scaling when configured."""
    r = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r))
    scaling = args.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rotary(x, cos, sin, rotary_dim):
    # x: [B, T, H, D]; cos, sin: [B, T, 1, rotary_dim / 2] in fp32.
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def no_communication(x):
    return x


# A step: decode (1 token a row), draft catch-up (2) or verify (K + 1). few_rows.cpp computes each row of a step by
# itself, whatever the number of rows, so a verify's rows are bit for bit a decode step's and speculation stays
# exact in bf16 (a verify of 17 rows once took PyTorch's GEMM, which rounds otherwise, and K = 16 changed the text).
MAX_SPECULATE_K = 32
STEP_TOKENS = MAX_SPECULATE_K + 1  # the most tokens a row has in a step
FEW_ROWS = 16  # rows per few_rows.cpp call where a prompt's products are chunked (quantize.MXLinear)
KERNELS_SOURCE = Path(__file__).with_name("few_rows.cpp")
few_rows_kernels = None  # whether few_rows.cpp is built and loaded; None: not tried yet


def cpu_features() -> str:
    """What -march=native compiles for: this CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        import platform
        return platform.machine() + platform.processor()


def kernels_build_name(source: str, march: str) -> str:
    """The build's name, a hash of what made it (source, flags, torch, CPU features): a build from other sources
    is never loaded, and two checkouts or versions of this project on one machine keep a build each instead of
    rebuilding each other's under one name."""
    import hashlib
    made_of = "\0".join([source, march, torch.__version__, sys.version, cpu_features() if march == "native" else ""])
    return "few_rows_" + hashlib.sha256(made_of.encode()).hexdigest()[:16]


def load_kernels(march: str = "native"):
    """Build few_rows.cpp for `march` (once per source: torch caches it under TORCH_EXTENSIONS_DIR, by default
    ~/.cache/torch_extensions) and load its ops; the first build says so on stderr, with the time it took."""
    import os
    from torch.utils.cpp_extension import get_default_build_root, load
    name = kernels_build_name(KERNELS_SOURCE.read_text(), march)
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not (directory / f"{name}.so").is_file()
    if fresh:
        print(f"building few_rows.cpp for this CPU (-march={march}, once per source)...", end="", file=sys.stderr,
              flush=True)
    start = time.perf_counter()
    try:
        load(name=name, sources=[str(KERNELS_SOURCE)], build_directory=str(directory), is_python_module=False,
             extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except BaseException:
        if fresh:
            print(" failed", file=sys.stderr)
        raise
    if fresh:
        print(f" done in {time.perf_counter() - start:.0f} s, cached in {directory}", file=sys.stderr)


def build_few_rows_kernels():
    """Load few_rows.cpp built for this CPU, once per process (load_kernels).

    Without a C++ compiler, products fall back to PyTorch's kernels: the same math, slower for a few rows."""
    global few_rows_kernels
    if few_rows_kernels is not None:
        return few_rows_kernels
    try:
        load_kernels()
    except Exception as error:  # no compiler, no ninja, unknown flags: run without, and say so once
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
        print(f"warning: few_rows.cpp did not build ({reason[:200]}); few-row products use PyTorch's "
              "kernels, slower on CPU", file=sys.stderr)
        few_rows_kernels = False
        return False
    # Shapes for torch.compile, which traces without running the kernels.
    def rows_by_outputs(x, weight, factors=None, table=None):
        return x.new_empty(x.shape[0], weight.shape[0])
    torch.library.register_fake("few_rows::product")(rows_by_outputs)
    torch.library.register_fake("few_rows::attention")(lambda q, k, v, positions: torch.empty_like(q))
    torch.library.register_fake("few_rows::argmax")(lambda x: x.new_empty(x.shape[:-1], dtype=torch.long))
    torch.library.register_fake("few_rows::llama_step")(
        lambda tokens, positions, embeddings, *rest: embeddings.new_empty(*tokens.shape, rest[3][-1].shape[0]))
    torch.ops.few_rows.keep_frame_chunks()  # no mmap / munmap per op call in compiled steps: see few_rows.cpp
    few_rows_kernels = True
    return True


def step_rows(x) -> bool:
    """Whether x [..., T, K] holds the rows of a step (T <= STEP_TOKENS), which few_rows.cpp computes one by one."""
    return x.dim() >= 2 and x.shape[-2] <= STEP_TOKENS


def few_rows(x, weight) -> bool:
    """Whether x @ weight.T takes few_rows.cpp: a step's rows (step_rows), a contiguous bf16 / fp32 / int8 weight (or
    uint8 int4 nibbles) on CPU, once the file is built (fp16 and the ONNX export take PyTorch's kernels)."""
    return (few_rows_kernels and weight.device.type == "cpu" and step_rows(x)
            and x.shape[-1] % 16 == 0 and weight.dtype in (torch.bfloat16, torch.float32, torch.int8, torch.uint8)
            and weight.is_contiguous() and not torch.onnx.is_in_onnx_export())


def few_rows_linear(x, weight, factors=None, table=None):
    """x [..., K] @ (weight [N, K] x factors).T in float32, by few_rows.cpp; factors: [N] or [N, K / block]. With a
    table (quantize.MXLinear): weight holds packed 6-bit codes of the table's values, factors their E8M0 scales."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.few_rows.product(rows, weight, factors, table).view(*x.shape[:-1], weight.shape[0])


def few_rows_attention(x, q, k) -> bool:
    """Whether the attention of q [B, H, R, D] (from x, a step's rows) over the cache k takes few_rows.cpp."""
    return (few_rows_kernels and q.device.type == "cpu" and step_rows(x)
            and q.shape[-1] % 16 == 0 and q.dtype in (torch.bfloat16, torch.float32) and k.dtype == q.dtype
            and not torch.onnx.is_in_onnx_export())


def argmax(logits):
    """logits.argmax(-1), by few_rows.cpp on CPU: Inductor's reduction took ~1 ms for a verify's 5 x 49152 logits."""
    if (few_rows_kernels and logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
            and not torch.onnx.is_in_onnx_export()):
        return torch.ops.few_rows.argmax(logits.contiguous())
    return logits.argmax(-1)


# Without native bf16 (AVX2), the CPU runs a 16-bit GEMM ~5-6x slower than a float32 one, conversions included:
# 130 x 576 @ 576 x 1728 in bf16 13.1 ms, fp16 11.1, float32 1.9-2.2. A 125-token bf16 SmolLM2 prefill took 1.4 s.
CPU_GEMM_IN_FLOAT32 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def many_rows_linear(x, weight, bias=None):
    """F.linear for many rows (a prompt), in x's dtype: on such a CPU, float32 rounded once."""
    if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and CPU_GEMM_IN_FLOAT32
            and not torch.onnx.is_in_onnx_export()):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class Linear(nn.Linear):
    """nn.Linear; a few rows on CPU (decode, draft, verify) go to few_rows.cpp.

    Without native bf16 FMA, the CPU GEMM converts bf16 slowly, and at 5 rows (a verify) it costs ~4 one-row
    products; few_rows.cpp reads each weight once for all rows, and gives every row the same arithmetic
    whatever the number of rows, so a verify computes the logits a decode step would (speculation stays
    token-identical in bf16). Measured on the 49152 x 576 bf16 LM head, 1 / 5 rows (Intel Xeon, AVX-512 without
    BF16): 2.3 / 4.9 ms, F.linear 2.8 / 12.3.
    """

    def forward(self, x):
        if few_rows(x, self.weight):
            y = few_rows_linear(x, self.weight)
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return many_rows_linear(x, self.weight, self.bias)

    # FusedProducts: what few_rows.cpp multiplies, and pointing the layer at its rows of a fused copy.
    def few_rows_operands(self):
        return (self.weight, None) if self.weight.dtype in (torch.bfloat16, torch.float32) else None

    def use_operands(self, weight, factors):
        self.weight = nn.Parameter(weight, requires_grad=False)

    # Tensor parallelism (tp.py) keeps a slice of the layer on each rank. Row slices of a mapped file stay views.
    def select_outputs(self, index):
        self.weight = nn.Parameter(self.weight[index].contiguous(), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias[index].contiguous(), requires_grad=False)
        self.out_features = self.weight.shape[0]

    def select_inputs(self, start, stop):
        self.weight = nn.Parameter(self.weight[:, start:stop].contiguous(), requires_grad=False)
        self.in_features = self.weight.shape[1]


class FusedProducts(nn.Module):
    """Layers that read the same input (q/k/v, gate/up) as one few_rows.cpp call over their weights stacked
    by output rows, then split: SmolLM2's 211 products a step become 121. Measured over its int8 products (2
    threads, same process): 10.1 -> 9.7 ms at 1 row, 17.9 -> 15.8 at 5 (a pass over 3-7 rows parallelizes
    better over more output rows). Every output is the same sum as in its own layer, so the bits do not change.
    The layers keep their parameters, now views into the stacked copy; other inputs (prefill, the ONNX
    export) still go through them one by one."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers  # a plain list: the layers stay where the state dict has them
        operands = [layer.few_rows_operands() for layer in layers]
        self.weight = torch.cat([w for w, _ in operands])
        self.factors = None if operands[0][1] is None else torch.cat([f for _, f in operands])
        self.table = getattr(layers[0], "table", None)  # quantize.MXLinear's packed 6-bit codes
        self.bias = None if layers[0].bias is None else torch.cat([layer.bias.float() for layer in layers])
        self.sizes = [w.shape[0] for w, _ in operands]
        self.use_operands(self.weight, self.factors)

    def few_rows_operands(self):
        return self.weight, self.factors

    def use_operands(self, weight, factors):
        """Take weight and factors stacked as the layers are, and point each layer at its rows of them."""
        self.weight, self.factors = weight, factors
        start = 0
        for layer, size in zip(self.layers, self.sizes):
            layer.use_operands(weight[start:start + size], None if factors is None else factors[start:start + size])
            start += size

    @staticmethod
    def fusable(layers) -> bool:
        operands = [layer.few_rows_operands() for layer in layers]
        if (any(o is None for o in operands) or len({type(layer) for layer in layers}) > 1
                or len({id(getattr(layer, "table", None)) for layer in layers}) > 1):  # one table per MX format
            return False
        (w0, f0), b0 = operands[0], layers[0].bias is None
        return all(w.dtype == w0.dtype and w.shape[1:] == w0.shape[1:] and (f is None) == (f0 is None) and
                   (f is None or f.shape[1:] == f0.shape[1:]) and (layer.bias is None) == b0
                   for (w, f), layer in zip(operands, layers))

    def forward(self, x):
        if not few_rows(x, self.weight):
            return [layer(x) for layer in self.layers]
        y = few_rows_linear(x, self.weight, self.factors, self.table)
        y = (y if self.bias is None else y + self.bias).to(x.dtype)
        return y.split(self.sizes, -1)


HUGE_PAGE = 2 << 20


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of private anonymous memory, 2 MiB-aligned and advised for transparent huge pages where the
    OS has them (Linux; a shared mapping would not get them), else plain memory."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the region alive as long as a view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


class HugePages:
    """Tensors carved back to back, on cache-line boundaries, out of huge-page regions of 64 MiB (or one tensor's
    size): a model's layers then share whole 2 MiB pages, where a region per layer left each layer's tail (over
    40% of an int8 SmolLM2 layer) in 4 KiB pages. A region's unused end is never touched, so it costs no memory."""

    def __init__(self, chunk=64 << 20):
        self.chunk, self.memory, self.offset = chunk, None, 0

    def like(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if self.memory is None or self.offset + nbytes > self.memory.numel():
            self.memory, self.offset = huge_page_memory(max(self.chunk, nbytes)), 0
        copy = self.memory[self.offset:self.offset + nbytes].view(t.dtype).view(t.shape)
        self.offset += -(-nbytes // 64) * 64
        return copy


def move_to_huge_pages(products, pages: HugePages):
    """Copy what few_rows.cpp streams for these products (layers or FusedProducts, in call order) into huge pages,
    and point them at the copies. The weights a step reads otherwise sit in 4 KiB pages, of the mapped file or of
    the heap: a TLB miss every 4 KiB of a stream that reads ~30 GB/s. Measured on SmolLM2 (Zen 4, 2 threads, same
    process, seven alternating runs): its 121 bf16 products 11.8 -> 9.7 ms, int8 6.8 -> 6.0, mxfp6 5.2 -> 4.6;
    the file's own pages 12.3 ms, the heap's 11.0. One tensor at a time, each old copy freed before the next is
    made: loading holds at most one tensor twice."""
    for product in products:
        for i in range(2):
            operands = list(product.few_rows_operands() or (None, None))
            old = operands[i]
            if old is None:
                continue
            operands[i] = pages.like(old)
            operands[i].copy_(old)
            del old
            product.use_operands(*operands)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd, bias = args.head_dim, args.qkv_bias
        self.wq = Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = Linear(args.n_heads * hd, args.dim, bias=False)
        self.wqkv = None  # FusedProducts of wq, wk, wv (Block.fuse_products)
        self.kv_cache = None
        # Set by tensor parallelism to the heads held by this rank.
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        hd, r = self.args.head_dim, self.args.rotary_dim
        q, k, v = self.wqkv(x) if self.wqkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        q = apply_rotary(q.view(B, T, self.n_heads, hd), cos, sin, r)
        k = apply_rotary(k.view(B, T, self.n_kv_heads, hd), cos, sin, r)
        v = v.view(B, T, self.n_kv_heads, hd)
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, H_kv, L, D]
        # Grouped-query attention without repeating the cache: the G query heads that share a KV head are
        # folded into the query-length axis, [B, H_kv, G * T, D].
        groups = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2).reshape(B, self.n_kv_heads, groups * T, hd)
        if few_rows_attention(x, q, k):
            # Each query row by itself, as in a one-token step: a verify attends exactly as decode would.
            y = torch.ops.few_rows.attention(q.contiguous(), k, v, input_pos.contiguous())
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.view(B, self.n_heads, T, hd).transpose(1, 2).reshape(B, T, self.n_heads * hd)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.family == "llama"
        bias = args.family == "codegen"
        self.w1 = Linear(args.dim, args.intermediate_size, bias=bias)
        self.w2 = Linear(args.intermediate_size, args.dim, bias=bias)
        if self.gated:
            self.w3 = Linear(args.dim, args.intermediate_size, bias=False)
        self.w13 = None  # FusedProducts of w1, w3 (Block.fuse_products)

    def forward(self, x):
        if self.gated:
            gate, up = self.w13(x) if self.w13 is not None else (self.w1(x), self.w3(x))
            return self.w2(F.silu(gate) * up)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(args: ModelArgs):
    if args.family == "codegen":
        return nn.LayerNorm(args.dim, eps=args.norm_eps)
    return RMSNorm(args.dim, args.norm_eps)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.parallel = args.family == "codegen"
        self.attention_norm = make_norm(args)
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        if not self.parallel:
            self.ffn_norm = make_norm(args)
        # Tensor parallelism (tp.py) makes this an all-reduce: each rank's attention and MLP outputs are then
        # partial sums. CodeGen's parallel branches share one.
        self.reduce = no_communication

    def products(self):
        """The products of a few-row step, in call order: FusedProducts where fused, else the layers."""
        attention, mlp = self.attention, self.feed_forward
        qkv = [attention.wqkv] if attention.wqkv is not None else [attention.wq, attention.wk, attention.wv]
        gate_up = [mlp.w13] if mlp.w13 is not None else [mlp.w1] + ([mlp.w3] if mlp.gated else [])
        return qkv + [attention.wo] + gate_up + [mlp.w2]

    def fuse_products(self):
        """One few_rows.cpp call for q/k/v and one for gate/up (FusedProducts), where their parts allow it."""
        attention, mlp = self.attention, self.feed_forward
        if FusedProducts.fusable([attention.wq, attention.wk, attention.wv]):
            attention.wqkv = FusedProducts([attention.wq, attention.wk, attention.wv])
        if mlp.gated and FusedProducts.fusable([mlp.w1, mlp.w3]):
            mlp.w13 = FusedProducts([mlp.w1, mlp.w3])

    def forward(self, x, cos, sin, mask, input_pos):
        if self.parallel:
            h = self.attention_norm(x)
            return x + self.reduce(self.attention(h, cos, sin, mask, input_pos) + self.feed_forward(h))
        x = x + self.reduce(self.attention(self.attention_norm(x), cos, sin, mask, input_pos))
        return x + self.reduce(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.output = Linear(args.dim, args.vocab_size, bias=args.family == "codegen")
        self.tie_weights()
        self.max_batch_size = self.max_seq_len = 0
        self.one_call_operands = None  # setup_caches: see step_in_one_call_operands
        self.gather_logits = no_communication  # tp.py: an all-gather when the LM head is split by vocabulary

    def tie_weights(self):
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, batch_size: int, max_seq_len: int):
        """Allocate the static KV cache once; a request that fits the current cache reuses it."""
        if max_seq_len > self.args.max_seq_len:
            raise InputError(f"{max_seq_len} positions requested but the model's context (config.json "
                             f"max_seq_len) is {self.args.max_seq_len}; use a shorter prompt or fewer new tokens")
        if batch_size != self.max_batch_size or max_seq_len > self.max_seq_len:
            self.allocate_caches(batch_size, max_seq_len)
        # Taken anew for every request: the layers may have been swapped or sharded since the last one.
        self.one_call_operands = self.step_in_one_call_operands()

    def allocate_caches(self, batch_size: int, max_seq_len: int):
        weight = self.layers[0].attention_norm.weight
        dtype, device = weight.dtype, weight.device
        for layer in self.layers:
            attn = layer.attention
            attn.kv_cache = KVCache(batch_size, max_seq_len, attn.n_kv_heads, self.args.head_dim, dtype, device)
        self.max_batch_size, self.max_seq_len = batch_size, max_seq_len
        if device.type == "cpu":
            build_few_rows_kernels()
        inv_freq = rope_frequencies(self.args, device)
        angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def step_in_one_call_operands(self):
        """What few_rows.cpp's llama_step takes besides tokens and positions, or None where a step cannot run as
        one call: a few-row step (decode, draft, verify) of a Llama-family model on CPU, in bf16 or float32, in one
        process, with every product few_rows.cpp's (q/k/v and gate/up stacked: FusedProducts). The call does
        what forward does, rounding where its eager PyTorch rounds. Compiled by torch.compile instead, the ~150
        small kernels between the products, their Python calls and Dynamo's guards cost 1.5-2.8 ms a SmolLM2 decode
        step (bf16 12.28 -> 10.78 ms, int8 7.90 -> 6.30, int4 10.46 -> 7.69; Zen 4, one process)."""
        dtype, args = self.tok_embeddings.weight.dtype, self.args
        if (not few_rows_kernels or args.family != "llama" or dtype not in (torch.bfloat16, torch.float32)
                or self.tok_embeddings.weight.device.type != "cpu" or args.dim % 16 or args.head_dim % 16
                or self.gather_logits is not no_communication  # tensor parallel
                or any(layer.reduce is not no_communication for layer in self.layers)):
            return None
        products = [p for layer in self.layers for p in (layer.attention.wqkv, layer.attention.wo,
                                                         layer.feed_forward.w13, layer.feed_forward.w2)]
        products.append(self.output)
        norms = [n.weight for layer in self.layers for n in (layer.attention_norm, layer.ffn_norm)] + [self.norm.weight]
        operands = [getattr(p, "few_rows_operands", lambda: None)() for p in products]
        if (any(o is None or not o[0].is_contiguous() or o[0].shape[-1] % 16 for o in operands)
                or any(p.bias is not None for p in products if not isinstance(p, FusedProducts))
                or any(n.dtype != dtype for n in norms)):
            return None
        caches = [layer.attention.kv_cache for layer in self.layers]
        attention = self.layers[0].attention
        return (self.tok_embeddings.weight, self.rope_cos, self.rope_sin, norms, [w for w, _ in operands],
                [f for _, f in operands], [getattr(p, "table", None) for p in products],
                [p.bias if isinstance(p, FusedProducts) else None for p in products],  # float32 there (Qwen2's q/k/v)
                [c.k_cache for c in caches], [c.v_cache for c in caches], attention.n_heads, attention.n_kv_heads,
                args.norm_eps)

    def step_in_one_call(self, tokens) -> bool:
        """Whether forward(tokens, ...) without logits_idx runs as one few_rows.cpp call (step_in_one_call_operands)."""
        return (self.one_call_operands is not None and tokens.shape[-1] <= STEP_TOKENS
                and not torch.onnx.is_in_onnx_export())

    def forward(self, tokens, input_pos, logits_idx=None):
        """tokens, input_pos: [B, T]. logits_idx [B, N] (optional): only those positions get logits."""
        if logits_idx is None and self.step_in_one_call(tokens):
            return torch.ops.few_rows.llama_step(tokens.contiguous(), input_pos.contiguous(), *self.one_call_operands)
        B, T = tokens.shape
        cos = self.rope_cos[input_pos].unsqueeze(2)  # [B, T, 1, rotary_dim / 2]
        sin = self.rope_sin[input_pos].unsqueeze(2)
        # [B, 1, T, L]: a query at position p sees cache slots 0..p; repeated for the grouped query heads.
        # L from the cache itself, not from setup_caches: the ONNX export passes caches in as graph inputs.
        attn = self.layers[0].attention  # the heads held here (all of them, unless tensor parallel)
        slots = torch.arange(attn.kv_cache.k_cache.shape[2], device=tokens.device)
        mask = slots <= input_pos[:, None, :, None]
        mask = mask.repeat(1, 1, attn.n_heads // attn.n_kv_heads, 1)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        if logits_idx is not None:
            x = x.gather(1, logits_idx[..., None].expand(-1, -1, x.shape[-1]))
        return self.gather_logits(self.output(self.norm(x)))
