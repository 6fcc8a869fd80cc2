"""Triton kernels for the rows of a decode, draft or verify step on CUDA (1 to backend.LONGEST_VERIFY rows), exact by
construction: every row is computed with the same tile shape and the same order over k whatever the number of rows,
so a verify's row is a decode's row bit for bit (cuBLAS picks its kernel by shape, and a row of 8 need not round as
a row alone does). The weights are decoded in registers, never copied dequantized to memory. gpu.py serves them.

- `rows_product`: y [M, N] = x [M, K] @ W^T for bf16, int8 (per channel), int4 (groupwise), int4k (two-level
  factors) and MX (4, 6 and 8-bit codes, E8M0 scales) weights, the codes laid out at load in 32-bit words along k
  with the columns side by side (`layout`: a warp's loads across columns are contiguous; files unchanged), decoded by
  shifts and masks, MX elements and scales built from their bits (no table): the rows in tiles of BLOCK_M = 16 (a decode pads its one row with zeros: its bytes, not its flops, bound it), k in steps
  of 128 (64 where K is not a multiple of 128), split into slices by the weight's shape alone (k_parts), their float32
  partial sums added in slice order. Each weight is decoded as quantize.py's reference decodes it (to float32, then
  the input's dtype), and multiplied by tl.dot with float32 sums (bf16 operands on a GPU, float32 in the
  interpreter); the inputs are rounded beforehand as the reference rounds them (round_activations).
- `rows_attention`: each query row over the cache slots model.py's glue says it sees, in blocks of BLOCK_S slots, in
  parts of the cache fixed by its length (not by the number of rows), each with an online softmax in float32, the
  parts then combined in order.
- `rows_norm`: RMSNorm, one program a row, its sum of squares in one fixed order (PyTorch's own reduction picks its
  split by the number of rows).

Run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported): how
tests/gpu_kernels_checks.py checks them without a GPU.
"""
import functools
import os

import torch
import triton
import triton.language as tl

import mx
import quantize

# FORMAT: the format's code (quantize.Format.code), as the kernels read it
PLAIN, INT8, INT4, MX, INT4K = (tl.constexpr(code) for code in
                               (quantize.PLAIN, quantize.INT8, quantize.INT4, quantize.MX, quantize.INT4K))

BLOCK_M, BLOCK_N, BLOCK_S = 16, 32, 64
BLOCK_KS = (128, 64)  # a product's k step: the largest of these that divides its K (k_parts); 64 at least
WARPS, STAGES = 4, 3  # a product program's warps and its pipeline's depth (unmeasured on a GPU: docs/cuda.md)
# The interpreter multiplies bf16 operands wrongly: there they are float32 (exact for bf16 values, the same products)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def rounded(v, dtype: tl.constexpr):
    """float32 v in dtype, bf16 rounded to nearest even by its bits (as on the GPU; Triton's interpreter truncates)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def bf16_bytes(p, stride, mask):
    """The bf16 in the bytes at p (low) and p + stride (high), as float32."""
    bits = tl.load(p, mask=mask, other=0).to(tl.uint32) | (tl.load(p + stride, mask=mask, other=0).to(tl.uint32) << 8)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def element_value(code, BITS: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_FROM: tl.constexpr):
    """An MX element code's value (mx.decode_elements) from its bits, float32: no table."""
    if EBITS == 0:  # MXINT8: two's complement, times 2^-6
        return tl.where(code >= 128, code - 256, code).to(tl.float32) * 0.015625
    magnitude = code & ((1 << (BITS - 1)) - 1)
    bias: tl.constexpr = (1 << (EBITS - 1)) - 1
    # a normal code's exponent and mantissa bits placed as float32's, its exponent moved by an integer add; a
    # subnormal code (exponent 0) is its mantissa times the smallest step
    normal = ((magnitude << (23 - MBITS)) + ((127 - bias) << 23)).to(tl.float32, bitcast=True)
    subnormal = (magnitude & ((1 << MBITS) - 1)).to(tl.float32) * (2.0 ** (1 - bias - MBITS))
    value = tl.where(magnitude >> MBITS == 0, subnormal, normal)
    value = tl.where(code >> (BITS - 1) == 1, -value, value)
    return tl.where(magnitude >= NAN_FROM, float("nan"), value)


@triton.jit
def scale_value(e8m0):
    """2^(code - 127) of an E8M0 code, float32, from its bits (code 0: the subnormal 2^-127; 255: NaN)."""
    value = tl.where(e8m0 == 0, 0x00400000, e8m0 << 23).to(tl.float32, bitcast=True)
    return tl.where(e8m0 == 255, float("nan"), value)


@triton.jit
def word_codes(w_ptr, ks, cols, col_ok, N, BITS: tl.constexpr):
    """Codes [BLOCK_K, BLOCK_N] from int32 words along k (code_words): code k in bits (k % (32 / BITS)) * BITS of
    word k // (32 / BITS), the words of a k side by side for the columns."""
    per: tl.constexpr = 32 // BITS
    word = tl.load(w_ptr + (ks[:, None] // per) * N + cols[None, :], mask=col_ok[None, :], other=0)
    return (word >> ((ks[:, None] % per) * BITS)) & ((1 << BITS) - 1)


@triton.jit(do_not_specialize=["M"])  # a specialization for M == 1 would be another kernel for a decode
def product_kernel(x_ptr, w_ptr, factors_ptr, out_ptr, partial_ptr, M, N, K, group, K_PART,
                   FORMAT: tl.constexpr, BITS: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                   NAN_FROM: tl.constexpr, PRECISION: tl.constexpr, AS_FLOAT32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(2)  # of PARTS slices of k, K_PART each (a multiple of BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(part * K_PART, tl.minimum(part * K_PART + K_PART, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None], other=0.0)
        if FORMAT == PLAIN:  # [N, K]
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=col_ok[None, :], other=0.0)
        elif FORMAT == INT8:  # codes [N, K]
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=col_ok[None, :], other=0).to(tl.float32)
            w = w.to(x.dtype)
        elif FORMAT == INT4:  # factors [2, K / group, N]: the scales, then the zeros
            code = word_codes(w_ptr, ks, cols, col_ok, N, 4)
            at_group = (ks[:, None] // group) * N + cols[None, :]
            scale = tl.load(factors_ptr + at_group, mask=col_ok[None, :], other=0.0).to(tl.float32)
            zero = tl.load(factors_ptr + (K // group) * N + at_group, mask=col_ok[None, :], other=0.0).to(tl.float32)
            w = rounded((code.to(tl.float32) - 8.0) * scale + zero, x.dtype)
        elif FORMAT == INT4K:  # factors [ceil(K / 256), 20, N] bytes: d, dmin (bf16), 8 scales, 8 minimums (int8)
            code = word_codes(w_ptr, ks, cols, col_ok, N, 4)
            at_super = (ks[:, None] // 256) * 20 * N + cols[None, :]
            block = ((ks[:, None] // 32) % 8) * N
            d = bf16_bytes(factors_ptr + at_super, N, col_ok[None, :])
            dmin = bf16_bytes(factors_ptr + at_super + 2 * N, N, col_ok[None, :])
            scale = tl.load(factors_ptr + at_super + 4 * N + block, mask=col_ok[None, :], other=0).to(tl.float32)
            low = tl.load(factors_ptr + at_super + 12 * N + block, mask=col_ok[None, :], other=0).to(tl.int32)
            minimum = tl.where(low >= 128, low - 256, low).to(tl.float32)  # the byte as int8
            w = rounded(code.to(tl.float32) * (d * scale) + dmin * minimum, x.dtype)
        else:  # MX: E8M0 scales [K / 32, N]
            if BITS == 6:  # two planes: the codes' low 4 bits, then their high 2 (code_words)
                code = word_codes(w_ptr, ks, cols, col_ok, N, 4)
                code |= word_codes(w_ptr + (K // 8) * N, ks, cols, col_ok, N, 2) << 4
            else:
                code = word_codes(w_ptr, ks, cols, col_ok, N, BITS)
            e8m0 = tl.load(factors_ptr + (ks[:, None] // 32) * N + cols[None, :], mask=col_ok[None, :], other=127)
            value = element_value(code, BITS, EBITS, MBITS, NAN_FROM) * scale_value(e8m0.to(tl.int32))
            w = rounded(value, x.dtype)
        # bf16 operands on a GPU (exact products, float32 sums, every row of the tile alike); float32 in the
        # interpreter (a bf16 value is exact in float32: the same products); float32 models in full float32 ("ieee")
        if AS_FLOAT32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, w, acc)
    if PARTS == 1:
        finish(acc, factors_ptr, out_ptr, rows, cols, M, N, FORMAT)
    else:  # float32 partial sums [PARTS, M, N], added by sum_parts_kernel
        tl.store(partial_ptr + (part * M + rows[:, None]) * N + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def sum_parts_kernel(partial_ptr, factors_ptr, out_ptr, M, N, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    at, ok = rows[:, None] * N + cols[None, :], (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.load(partial_ptr + at, mask=ok, other=0.0)
    for part in tl.static_range(1, PARTS):  # in order: the same sum for every number of rows
        acc += tl.load(partial_ptr + part * M * N + at, mask=ok, other=0.0)
    finish(acc, factors_ptr, out_ptr, rows, cols, M, N, FORMAT)


@triton.jit
def finish(acc, factors_ptr, out_ptr, rows, cols, M, N, FORMAT: tl.constexpr):
    """A tile's float32 sums, rounded to the output's dtype (int8: times its scales first) and stored."""
    col_ok = cols < N
    y = rounded(acc, out_ptr.dtype.element_ty)
    if FORMAT == INT8:  # the reference: (x @ codes) in the input's dtype, times the scales in it
        scale = tl.load(factors_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = rounded(y.to(tl.float32) * scale[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=(rows < M)[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def attention_kernel(q_ptr, k_ptr, v_ptr, visible_ptr, range_ptr, out_ptr, part_ptr, T, R, S, heads, scale, S_PART,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, PARTS: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    b, part = tl.program_id(2) // PARTS, tl.program_id(2) % PARTS  # slots part * S_PART .. of the cache
    seen_ptr = visible_ptr + (b * T + r % T) * S  # the slots this row's token sees, first .. last of them
    first = tl.load(range_ptr + (b * T + r % T) * 2)
    last = tl.load(range_ptr + (b * T + r % T) * 2 + 1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + ((b * heads + h) * R + r) * D + d).to(tl.float32)
    cache = (b * heads + h) * S * D
    best = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    start = tl.maximum(part * S_PART, first // BLOCK_S * BLOCK_S)
    for s0 in range(start, tl.minimum(part * S_PART + S_PART, last + 1), BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        seen = tl.load(seen_ptr + slots, mask=slots <= last, other=0) != 0
        k = tl.load(k_ptr + cache + slots[:, None] * D + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        score = tl.where(seen, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(score, 0))
        # (a block or a start that sees nothing: -inf minus -inf is no number, and it weighs nothing)
        p = tl.where(seen, tl.exp(score - new_best), 0.0)
        kept = tl.where(best > float("-inf"), tl.exp(best - new_best), 0.0)
        v = tl.load(v_ptr + cache + slots[:, None] * D + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        total = total * kept + tl.sum(p, 0)
        acc = acc * kept + tl.sum(p[:, None] * v, 0)
        best = new_best
    row = (b * heads + h) * R + r
    if PARTS == 1:
        tl.store(out_ptr + row * D + d, rounded(acc / total, out_ptr.dtype.element_ty))
    else:  # this part's (max score, sum of exponentials, weighted values): [B * H * R, PARTS, D + 2] floats
        at = part_ptr + (row * PARTS + part) * (D + 2)
        tl.store(at + d, acc)
        tl.store(at + D + tl.arange(0, 1), best)
        tl.store(at + D + 1 + tl.arange(0, 1), total)


@triton.jit
def attention_parts_kernel(part_ptr, out_ptr, D: tl.constexpr, PARTS: tl.constexpr):
    """A row's parts of the cache combined in order: the same sums for a decode's row and a verify's."""
    row = tl.program_id(0)
    d = tl.arange(0, D)
    base = part_ptr + row * PARTS * (D + 2)
    best = tl.load(base + D + tl.arange(0, 1))
    for part in tl.static_range(1, PARTS):  # the largest score of any part (an empty part's is -inf)
        best = tl.maximum(best, tl.load(base + part * (D + 2) + D + tl.arange(0, 1)))
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for part in tl.static_range(PARTS):
        at = base + part * (D + 2)
        part_best = tl.load(at + D + tl.arange(0, 1))
        kept = tl.where(part_best > float("-inf"), tl.exp(part_best - best), 0.0)
        total += tl.load(at + D + 1 + tl.arange(0, 1)) * kept
        acc += tl.load(at + d) * kept
    tl.store(out_ptr + row * D + d, rounded(acc / total, out_ptr.dtype.element_ty))


def code_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes as a file packs them (mx.pack: [N, K * bits / 8], LSB first) -> int32 words along k, a k's words side by
    side for the N columns (loads across columns are contiguous): [K * bits / 32, N], code k in bits (k % (32 / bits))
    * bits of word k // (32 / bits). 6-bit codes as two planes: their low 4 bits [K / 8, N], then their high 2 [K / 16,
    N]."""
    planes = [packed]
    if bits == 6:
        codes = mx.unpack(packed, 6)
        high = (codes >> 4).unflatten(-1, (-1, 4)).unbind(-1)
        planes = [mx.pack(codes & 15, 4), high[0] | high[1] << 2 | high[2] << 4 | high[3] << 6]
    return torch.cat([plane.contiguous().view(torch.int32).T for plane in planes]).contiguous()


def layout(weight: torch.Tensor, factors: torch.Tensor | None, fmt: int, bits: int):
    """A file's tensors (quantize.py's modules) as product_kernel reads them, made once at load: int4, int4k and MX
    codes in 32-bit words along k (code_words), their factors with the columns side by side (int4: [2, K / group, N],
    int4k: [ceil(K / 256), 20, N] bytes, MX: [K / 32, N]); bf16 and int8 as they are. -> (weight, factors)"""
    if fmt in (quantize.INT4, quantize.INT4K, quantize.MX):
        weight = code_words(weight, 4 if fmt != quantize.MX else bits)
        factors = factors.permute(2, 0, 1) if fmt == quantize.INT4 else factors.permute(1, 2, 0) \
            if fmt == quantize.INT4K else factors.T
    return weight, None if factors is None else factors.contiguous()


def rows_product(x, weight, factors=None, fmt=quantize.PLAIN, bits=16, group=0, n=None, element=None,
                 parts=None):
    """x [..., K] (already rounded as the reference rounds it) times a weight in layout()'s layout -> [..., N] in x's
    dtype. weight: bf16 [N, K]; int8 codes [N, K] with factors = scales [N]; int4's, int4k's and MX's words and
    factors as layout() makes them from the file's, element the MX codes' mx.ElementFormat. parts: slices of k
    (split-K) where not k_parts' choice (the tests)."""
    k = x.shape[-1]
    n = weight.shape[0] if n is None else n
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    factors = weight if factors is None else factors  # (unread but by the quantized formats)
    ebits, mbits, nan_from = (element.ebits, element.mbits, (1 << bits - 1) - len(element.nan_codes)) if element \
        else (0, 0, 0)
    parts, k_part, block_k = k_parts(n, k, x.device, parts)
    partial = torch.empty(parts, m, n, dtype=torch.float32, device=x.device) if parts > 1 else out
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    float32 = x.dtype == torch.float32
    product_kernel[grid + (parts,)](rows, weight, factors, out, partial, m, n, k, group, k_part, FORMAT=fmt, BITS=bits,
                                    EBITS=ebits, MBITS=mbits, NAN_FROM=nan_from,
                                    PRECISION="ieee" if float32 else "tf32", AS_FLOAT32=float32 or INTERPRETED,
                                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, PARTS=parts, num_warps=WARPS,
                                    num_stages=STAGES)
    if parts > 1:
        sum_parts_kernel[grid](partial, factors, out, m, n, FORMAT=fmt, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PARTS=parts)
    return out.view(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)  # (a step asks for each product's, every call)
def k_parts(n, k, device, parts=None) -> tuple[int, int, int]:
    """How many slices of k a product of N x K takes (split-K), their length and its k step: by its shape and the GPU
    alone, never by its rows (a decode's and a verify's rows then add the same partial sums in the same order). The
    largest step of BLOCK_KS that divides K; enough programs for two a multiprocessor, at least 4 steps a slice; or
    about `parts` slices."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    block_k = next((b for b in BLOCK_KS if k % b == 0), BLOCK_KS[-1])
    steps = k // block_k
    if parts is None:
        parts = max(1, min(steps // 4, triton.cdiv(2 * processors, triton.cdiv(n, BLOCK_N))))
    per_part = triton.cdiv(steps, parts)
    return triton.cdiv(steps, per_part), per_part * block_k, block_k


def rows_attention(q, k, v, visible, scale=None, parts=None):
    """softmax(q k^T * scale) v (scale 1 / sqrt(D) by default) for q [B, H, R, D] (R = G * T query rows of a KV head,
    row r being token r % T) over the cache k, v [B, H, S, D]: each row over the slots visible [B, T, S] gives its
    token."""
    b, h, r, d = q.shape
    t, s = visible.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    slots = torch.arange(s, device=q.device, dtype=torch.int32)
    bounds = torch.stack([torch.where(visible, slots, s).amin(-1), torch.where(visible, slots, -1).amax(-1)], -1)
    parts, s_part = cache_parts(s, parts)
    partial = torch.empty(b * h * r, parts, d + 2, dtype=torch.float32, device=q.device) if parts > 1 else out
    attention_kernel[(r, h, b * parts)](q, k.contiguous(), v.contiguous(), visible.contiguous().view(torch.uint8),
                                        bounds.int().contiguous(), out, partial, t, r, s, h,
                                        d ** -0.5 if scale is None else scale, s_part, D=d, BLOCK_S=BLOCK_S,
                                        PARTS=parts)
    if parts > 1:
        attention_parts_kernel[(b * h * r,)](partial, out, D=d, PARTS=parts)
    return out


def cache_parts(slots, parts=None) -> tuple[int, int]:
    """How many parts of the cache a query row's attention takes, and their length in slots: by the cache's length
    alone (a decode's row and a verify's then combine the same parts), at least 4 blocks of BLOCK_S slots a part, at
    most 16 parts; or about `parts`."""
    blocks = triton.cdiv(slots, BLOCK_S)
    if parts is None:
        parts = max(1, min(16, blocks // 4))
    per_part = triton.cdiv(blocks, parts)
    return triton.cdiv(blocks, per_part), per_part * BLOCK_S


@triton.jit
def norm_kernel(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    seen = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=seen, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / dim + eps)
    normed = rounded(x * scale, x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=seen, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, rounded(w * normed, out_ptr.dtype.element_ty), mask=seen)


def rows_norm(x, weight, eps):
    """model.rms_norm for x [..., dim] and weight [dim] of x's dtype: each row in one program, one order of sums."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rows.shape[1], eps,
                                  BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


# The kernels as custom ops: torch.compile (fullgraph, CUDA graphs) calls them as they are, and traces their shapes
# through the fake implementations.
@torch.library.custom_op("fastdecode::rows_product", mutates_args=())
def rows_product_op(x: torch.Tensor, weight: torch.Tensor, factors: torch.Tensor | None, fmt: int, bits: int,
                    group: int, n: int, element: str) -> torch.Tensor:
    return rows_product(x, weight, factors, fmt, bits, group, n, mx.FORMATS[element] if element else None)


@rows_product_op.register_fake
def _(x, weight, factors, fmt, bits, group, n, element):
    return x.new_empty(*x.shape[:-1], n)
