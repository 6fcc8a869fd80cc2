"""What the CPU backend puts in a model: products and attention served by few_rows.cpp, subclasses of model.py's and
quantize.py's modules with the runtime layouts the kernels read. (q/k/v and gate/up stacked and a Llama-family step
in one call: one_call.py; the weights a step streams in huge pages: huge_pages.py.)"""
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
        # float32 once at load: converting per call would cost a kernel launch per layer per step
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
    block of 32 codes times 32 inputs one exact integer dot product, then the group's scale and offset: faster than
    converting the codes to float or to the int8 layout, and than aten's int4 kernel, whose verify costs several
    decode steps (docs/performance.md, "Numbers behind the code's choices")."""

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
    # temporaries on the heap (which keeps the heap from giving them back).
    values = torch.empty(n, k, dtype=torch.int8 if multiple else torch.bfloat16)
    for i in range(0, n, rows):
        v = mx.decode_elements(mx.unpack(codes[i:i + rows], fmt.bits), fmt)
        values[i:i + rows] = (v * multiple).round() if multiple else v
    return values, mx.scale_values(scales) / (multiple or 1)


class MXLinear(quantize.MXLinear):
    """OCP MX. On a CPU with AVX512_VBMI and AVX512_BF16, few_rows.cpp reads 6-bit codes (E2M3, E3M2) as the file
    packs them, 6.25 bits per weight with the scales, faster than the codes expanded to int8. Elsewhere, and for the
    other formats, `prepare` expands the codes once:
    E2M3, E2M1 and INT8 to exact int8 multiples (value * 8, * 2, * 64), E3M2 and E4M3 to bf16 (exact), with one
    float32 factor per block, which few_rows.cpp multiplies in; a step then reads 8 (or 16) bits per weight plus 1
    for the factors. (Unpacking in plain vector code did not pay: FP4 expanded in registers by a 16-entry byte
    shuffle was slower than the int8 expansion.)"""

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
        if self.table is not None:  # packed codes, 16 rows a call (a prompt's rows: about as fast as int8's GEMM)
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
