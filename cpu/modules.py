"""What the CPU backend puts in a model: products and attention served by few_rows.cpp (subclasses of model.py's
and quantize.py's modules, with the runtime layouts the kernels read), q/k/v and gate/up stacked, the weights a
step streams in huge pages, and a Llama-family step in one call."""
import math
import mmap

import torch
import torch.nn as nn
import torch.nn.functional as F

import model
import mx
import quantize
from cpu.kernels import STEP_TOKENS, many_rows, product, step_rows


class Linear(nn.Linear):
    """nn.Linear: a step's rows through few_rows.cpp (which gives every row the arithmetic it gets alone, so a
    verify computes the logits a decode would); a prompt's through PyTorch's GEMM."""

    def prepare(self):
        pass

    def operands(self):  # (weight, factors, table) as few_rows.cpp takes them
        return self.weight, None, None

    def use_operands(self, weight, factors):
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        if step_rows(x):
            y = product(x, self.weight)
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return many_rows(x, self.weight, self.bias)


class Int8Linear(quantize.Int8Linear):
    """int8 codes converted to float in registers, times the per-channel scale once per output."""

    def prepare(self):
        # float32 once at load: converting per call costs a kernel launch per layer per step (~2 ms of a 12 ms step)
        self.scale_factors = self.scales.float()

    def operands(self):
        return self.weight, self.scale_factors, None

    def use_operands(self, weight, factors):
        self.weight, self.scale_factors = weight, factors

    def forward(self, x):
        y = product(x, self.weight, self.scale_factors) if step_rows(x) else many_rows(x, self.dequantize())
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def int4_layout(codes, scales_and_zeros):
    """few_rows.cpp's int4 layout from the file's: codes [N, K] (0..15) with byte j of each 32 holding code j of
    each 64 in its low nibble and code 32 + j in its high one (a mask and a shift unpack two blocks of 32 codes
    into bytes; a last lone block of 32: byte j of 16 holds codes j and 16 + j), and float32
    (scale, zero - 8 * scale) per group [N, K / g, 2]: w = q * scale + offset."""
    n, k = codes.shape
    whole = k // 64 * 64
    pairs = [codes[:, :whole].reshape(n, -1, 2, 32)] + ([codes[:, whole:].reshape(n, 1, 2, 16)] if k > whole else [])
    nibbles = torch.cat([(p[:, :, 0] | p[:, :, 1] << 4).flatten(1) for p in pairs], 1)
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)
    return nibbles, torch.stack([scales, zeros - 8 * scales], -1).contiguous()


class Int4Linear(quantize.Int4Linear):
    """int4 codes multiplied as integers: each input row rounded to 8 bits per block of 32 (round_activations), a
    block of 32 codes times 32 inputs one exact integer dot product, then the group's scale and offset. Over
    SmolLM2's 211 products (g = 32, 2 threads, Zen 3) 8.6 ms at one row, against 11.3 for converting the codes to
    float and 12.2 for the int8 layout; aten's int4 kernel took 14.4 ms for a whole 1-row step and a verify at 5
    rows cost it 2.3 decode steps."""

    def prepare(self, rows=1024):
        n, k = self.weight.shape[0], 2 * self.weight.shape[1]
        self.nibbles = torch.empty(n, k // 2, dtype=torch.uint8)  # filled in place, a few rows at a time
        self.group_factors = torch.empty(n, k // self.groupsize, 2)
        for i in range(0, n, rows):
            self.nibbles[i:i + rows], self.group_factors[i:i + rows] = int4_layout(
                mx.unpack(self.weight[i:i + rows], 4), self.scales_and_zeros[:, i:i + rows])

    def operands(self):
        return self.nibbles, self.group_factors, None

    def use_operands(self, nibbles, group_factors):
        self.nibbles, self.group_factors = nibbles, group_factors

    def forward(self, x):
        if step_rows(x):
            y = product(x, self.nibbles, self.group_factors)  # rounds x as round_activations does
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        y = many_rows(quantize.round_activations(x), self.dequantize())
        return y if self.bias is None else y + self.bias.to(x.dtype)


# Element formats whose every value is an integer multiple of 1/MULTIPLE with |value * MULTIPLE| <= 127.
INT8_EXACT = {"fp6_e2m3": 8, "fp4_e2m1": 2, "int8": 64}
code_tables = {}


def code_table(fmt: mx.ElementFormat) -> torch.Tensor:
    """The values of a 6-bit format's 64 codes as bf16 (exact), one tensor per format (shared by stacked layers)."""
    if fmt.name not in code_tables:
        code_tables[fmt.name] = mx.decode_elements(torch.arange(64, dtype=torch.uint8), fmt).bfloat16()
    return code_tables[fmt.name]


def expand(codes, scales, fmt, rows=256):
    """Packed MX codes [N, K * bits / 8] and their E8M0 scales -> (values [N, K], a float32 factor per block of 32):
    exact int8 multiples (value * 8, * 2, * 64 for E2M3, E2M1, INT8) or bf16 (E3M2, E4M3)."""
    multiple = INT8_EXACT.get(fmt.name)
    n, k = codes.shape[0], scales.shape[1] * mx.BLOCK
    # Filled in place a few rows at a time: no full float32 copy, and no result chunks interleaved with freed
    # temporaries on the heap (concatenated chunks left SmolLM2 mxfp6 at +462 MiB after loading, +388 this way).
    values = torch.empty(n, k, dtype=torch.int8 if multiple else torch.bfloat16)
    for i in range(0, n, rows):
        v = mx.decode_elements(mx.unpack(codes[i:i + rows], fmt.bits), fmt)
        values[i:i + rows] = (v * multiple).round() if multiple else v
    return values, mx.scale_values(scales) / (multiple or 1)


class MXLinear(quantize.MXLinear):
    """OCP MX. On a CPU with AVX512_VBMI and AVX512_BF16, few_rows.cpp reads 6-bit codes (E2M3, E3M2) as the file
    packs them, 6.25 bits per weight with the scales: SmolLM2's mxfp6 products 4.37 ms against 4.95-5.01 with the
    codes expanded to int8 (Zen 4, 1 row). Elsewhere, and for the other formats, `prepare` expands the codes once:
    E2M3, E2M1 and INT8 to exact int8 multiples (value * 8, * 2, * 64), E3M2 and E4M3 to bf16 (exact), with one
    float32 factor per block, which few_rows.cpp multiplies in; a step then reads 8 (or 16) bits per weight plus 1
    for the factors. (Unpacking in plain vector code did not pay: FP4 expanded in registers by a 16-entry byte
    shuffle, over SmolLM2's products on 2 AVX2 cores, 12.3 / 20.3 ms at 1 / 5 rows against 10.6 / 17.0 for the
    int8 expansion.)"""

    def prepare(self):
        self.values = self.block_factors = self.table = None
        if self.fmt.bits == 6 and torch.ops.few_rows.packed_fp6_is_fast():
            self.table = code_table(self.fmt)
        else:
            self.values, self.block_factors = expand(self.weight, self.scales, self.fmt)

    def operands(self):  # the packed codes and their scales, or the expanded codes and their factors
        if self.table is not None:
            return self.weight, self.scales, self.table
        return self.values, self.block_factors, None

    def use_operands(self, weight, factors):
        if self.table is not None:
            self.weight, self.scales = weight, factors
        else:
            self.values, self.block_factors = weight, factors

    def forward(self, x):
        if self.table is not None:  # packed codes, 16 rows a call (a 130-token SmolLM2 prompt: 0.41 s; int8 0.38)
            rows = x.reshape(-1, x.shape[-1]).split(16)
            parts = [product(part, self.weight, self.scales, self.table) for part in rows]
            y = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(*x.shape[:-1], -1)
        elif step_rows(x):
            y = product(x, self.values, self.block_factors)
        else:  # a prompt: this layer decoded into a temporary weight
            y = F.linear(x.float(), self.values.float() * self.block_factors.repeat_interleave(mx.BLOCK, -1))
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


PRODUCTS = {nn.Linear: Linear, quantize.Int8Linear: Int8Linear, quantize.Int4Linear: Int4Linear,
            quantize.MXLinear: MXLinear}


class Attention(model.Attention):
    """A step's query rows attend the KV cache in few_rows.cpp, each row by itself, as in a one-token step: a verify
    attends exactly as decode would. A prompt's take model.py's SDPA."""

    def attend(self, q, k, v, mask, input_pos):
        if (input_pos.shape[-1] <= STEP_TOKENS and q.shape[-1] % 16 == 0 and q.dtype in (torch.bfloat16, torch.float32)
                and k.dtype == q.dtype):
            return torch.ops.few_rows.attention(q.contiguous(), k, v, input_pos.contiguous())
        return super().attend(q, k, v, mask, input_pos)


class Stack:
    """Products that read the same input (q/k/v, gate/up) as one few_rows.cpp call over their operands stacked by
    output rows (as the one-call step takes them): SmolLM2's 211 products a step become 121. The products keep their
    operands, now views into the stacked copy, and every output is the same sum as in its own product."""

    def __init__(self, products, pages=None):
        """pages: a HugePages to stack the operands into (one copy of them, not a stacked copy copied again)."""
        self.products = products
        operands = [p.operands() for p in products]
        empty = pages.empty if pages else torch.empty

        def stacked(tensors):
            out = empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype)
            with torch.no_grad():  # weights that are parameters: cat(out=...) refuses them under autograd
                return torch.cat(tensors, out=out)
        self.weight = stacked([w for w, _, _ in operands])
        self.factors = None if operands[0][1] is None else stacked([f for _, f, _ in operands])
        self.table = operands[0][2]
        self.bias = None if products[0].bias is None else torch.cat([p.bias.float() for p in products])
        self.sizes = [w.shape[0] for w, _, _ in operands]
        self.use_operands(self.weight, self.factors)

    def operands(self):
        return self.weight, self.factors, self.table

    def use_operands(self, weight, factors):
        """Take weight and factors stacked as the products are, and point each product at its rows of them."""
        self.weight, self.factors = weight, factors
        start = 0
        for p, size in zip(self.products, self.sizes):
            p.use_operands(weight[start:start + size], None if factors is None else factors[start:start + size])
            start += size

    @staticmethod
    def stackable(products) -> bool:
        operands = [p.operands() for p in products]
        if len({type(p) for p in products}) > 1 or len({id(t) for _, _, t in operands}) > 1:
            return False
        (w0, f0, _), b0 = operands[0], products[0].bias is None
        return all(w.dtype == w0.dtype and w.shape[1:] == w0.shape[1:] and (f is None) == (f0 is None) and
                   (f is None or f.shape[1:] == f0.shape[1:]) and (p.bias is None) == b0
                   for (w, f, _), p in zip(operands, products))


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

    def empty(self, shape, dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self.memory is None or self.offset + nbytes > self.memory.numel():
            self.memory, self.offset = huge_page_memory(max(self.chunk, nbytes)), 0
        tensor = self.memory[self.offset:self.offset + nbytes].view(dtype).view(shape)
        self.offset += -(-nbytes // 64) * 64
        return tensor


def move_to_huge_pages(products, pages: HugePages):
    """Copy what few_rows.cpp streams for these products (or stacks, in call order) into huge pages, and point them
    at the copies. The weights a step reads otherwise sit in 4 KiB pages, of the mapped file or of the heap: a TLB
    miss every 4 KiB of a stream that reads ~30 GB/s (docs/performance.md has what that cost). One tensor at a
    time, each old copy freed before the next is made: loading holds at most one tensor twice. -> products"""
    for p in products:
        for i in range(2):
            operands = list(p.operands()[:2])
            old = operands[i]
            if old is None:
                continue
            operands[i] = pages.empty(old.shape, old.dtype)
            operands[i].copy_(old)
            del old
            p.use_operands(*operands)
    return products


class OneCallStep:
    """A Llama-family model's forward where a step (decode, draft catch-up or verify: no logits_idx, at most
    STEP_TOKENS tokens a row) is one call of few_rows.cpp's llama_step: embedding rows, per layer RMSNorm, the
    stacked q/k/v product, rotary, the cache writes, attention, the output product, the residual, RMSNorm, gate/up,
    SiLU times up, down and the residual, then the final norm and the LM head; each result rounded to the model's
    dtype where model.py's eager PyTorch rounds it, so a bf16 step gives its logits bit for bit (the backend checks
    that on every model before it serves). Other calls (prompts) take model.py's forward. It replaces ~150 small
    kernels, their Python calls and Dynamo's guards (docs/how-it-works.md has what that saved)."""

    def __init__(self, transformer, products):
        self.model = transformer
        self.products = products  # per layer: q/k/v stacked, wo, gate/up stacked, w2; then the LM head
        self.made_for, self.step_operands = None, None

    def operands(self):
        """What llama_step takes besides tokens and positions, taken anew when setup_caches has reallocated the
        caches (and with them the rotary tables: one identity check, where gathering them took 35 us a step)."""
        m = self.model
        if m.rope_cos is not self.made_for:
            caches = [layer.attention.kv_cache for layer in m.layers]
            norms = [n.weight for layer in m.layers for n in (layer.attention_norm, layer.ffn_norm)] + [m.norm.weight]
            operands = [p.operands() for p in self.products]
            self.step_operands = (
                m.tok_embeddings.weight, m.rope_cos, m.rope_sin, norms, [w for w, _, _ in operands],
                [f for _, f, _ in operands], [t for _, _, t in operands],
                [p.bias if isinstance(p, Stack) else None for p in self.products],  # float32 there (Qwen2's q/k/v)
                [c.k_cache for c in caches], [c.v_cache for c in caches], m.layers[0].attention.n_heads,
                m.layers[0].attention.n_kv_heads, m.args.norm_eps)
            self.made_for = m.rope_cos
        return self.step_operands

    def __call__(self, tokens, input_pos, logits_idx=None):
        if logits_idx is None and tokens.shape[-1] <= STEP_TOKENS:
            return torch.ops.few_rows.llama_step(tokens.contiguous(), input_pos.contiguous(), *self.operands())
        return model.Transformer.forward(self.model, tokens, input_pos, logits_idx)
