"""What the CPU backend puts in a model: products and attention served by few_rows.cpp, subclasses of model.py's and
quantize.py's modules with the runtime layouts the kernels read. (q/k/v and gate/up stacked and a Llama-family step
in one call: one_call.py; the weights a step streams in huge pages: huge_pages.py.)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import model
import mx
import quantize
from cpu.kernels import STEP_TOKENS, TILE, linear, many_rows, product, step_rows


def read_once(product):
    """What a prepared product's forward passes few_rows.cpp besides its operands, read once as plain attributes: the
    bias in float32 and the output features (nn.Module's lookup of a parameter or buffer, cold in a fork's MLP called
    from the step, cost a few microseconds a product)."""
    product.float_bias = None if product.bias is None else product.bias.float()
    product.outputs = product.weight.shape[0]


class Linear(nn.Linear):
    """nn.Linear. bf16 weights (in_features a multiple of 32): in column tiles (pair_tiles), every number of rows
    through few_rows.cpp, a prompt's too, each row with the arithmetic it gets alone (a verify computes the logits a
    decode would); the tiles are then its only copy (restore rebuilds the weight), but where an embedding shares the
    weight (a tied head). Others (float32): a step's rows through few_rows.cpp, a prompt's through PyTorch's GEMM."""

    replaces = {}  # nn.Linear's math is PyTorch's, not model.py's to edit

    def rounds_inputs(self):
        return False

    def prepare(self, shared=()):
        self.tiles = None
        if self.weight.dtype == torch.bfloat16 and self.in_features % 32 == 0:
            self.tiles = pair_tiles(self.weight.detach())
            if not any(self.weight is t for t in shared):  # a weight made from a float32 file would be held twice
                self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)
        read_once(self)

    def restore_weight(self):
        if self.weight.is_meta:
            self.weight = nn.Parameter(pair_weights(self.tiles, self.weight.shape[0]), requires_grad=False)

    def operands(self):  # (weight, factors, table) as few_rows.cpp takes them
        return (self.weight if self.tiles is None else self.tiles), None, None

    def use_operands(self, weight, factors):
        if self.tiles is None:
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.tiles = weight

    def forward(self, x):
        if self.tiles is not None or step_rows(x):
            weight = self.weight if self.tiles is None else self.tiles
            return linear(x, weight, None, None, self.float_bias, self.outputs)
        return many_rows(x, self.weight, self.bias)


def padded(t, n):
    """t [n0, ...] with rows of zeros after its own up to n (the outputs that fill a column tile)."""
    return t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


def whole_tiles(n):
    return -(-n // TILE) * TILE


def pair_tiles(weight):
    """few_rows.cpp's column tiles of 16-bit input pairs (few_rows/columns.h) from weights [N, K] (int8 codes or bf16):
    [N / 16, K / 32, 512] (N rounded up to whole tiles with zeros), where tile T's block b holds 16 pairs of k, element
    2c + j of pair p the weight of column 16T + c at k = 32b + 2p + j."""
    weight = padded(weight, whole_tiles(weight.shape[0]))
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 512)


def pair_weights(tiles, n):
    """pair_tiles' inverse: the weights [n, K] its tiles hold."""
    t, b = tiles.shape[:2]
    return tiles.view(t, b, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(t * 16, b * 32)[:n].clone()


def block_tiles(factors):
    """Per-block factors [N, K / 32] (float32 or E8M0 bytes) as the tiles read them: [N / 16, K / 32, 16]."""
    factors = padded(factors, whole_tiles(factors.shape[0]))
    return factors.view(-1, 16, factors.shape[1]).transpose(1, 2).contiguous()


def fp6_tiles(codes):
    """few_rows.cpp's MX 6-bit column tiles from codes [N, K] (0..63): [N / 16, K / 32, 384], where tile T's block b
    holds 8 quads of 48 bytes, each 64 codes packed as mx.pack packs them, code 32h + 2c + j of quad t being column
    16T + c's at k = 32b + 4t + 2h + j."""
    codes = padded(codes, whole_tiles(codes.shape[0]))
    n, k = codes.shape
    quads = codes.view(n // 16, 16, k // 32, 8, 2, 2).permute(0, 2, 3, 4, 1, 5).reshape(n // 16, k // 32, 8, 64)
    return mx.pack(quads, 6).reshape(n // 16, k // 32, 384)


class Int8Linear(quantize.Int8Linear):
    """int8 codes in column tiles (pair_tiles) times each input row rounded to 16 bits per block of 32
    (round_activations(x, WIDE)): exact integer sums, then each block's d and the column's scale (few_rows/columns.h).
    Every number of rows, a prompt's too."""

    # The math its kernel implements: the fingerprint and source hash of its quantize.py class's functions (gate.py).
    replaces = {"forward": ("b27930feeb5bd468", "f99dce03"), "dequantize": ("8dfc74cf09a780b6", "c67759bf")}

    def rounds_inputs(self):
        return True

    def prepare(self, rows=1024):
        n, k = self.weight.shape
        self.tiles = torch.empty(whole_tiles(n) // 16, k // 32, 512, dtype=torch.int8)  # filled a few rows at a time
        for i in range(0, n, rows):
            part = pair_tiles(self.weight[i:i + rows])
            self.tiles[i // 16:i // 16 + part.shape[0]] = part
        self.scale_factors = padded(self.scales.float(), whole_tiles(n)).view(-1, TILE)  # by tiles, as stacked
        read_once(self)

    def operands(self):
        return self.tiles, self.scale_factors, None

    def use_operands(self, tiles, scale_factors):
        self.tiles, self.scale_factors = tiles, scale_factors

    def forward(self, x):
        return linear(x, self.tiles, self.scale_factors, None, self.float_bias, self.outputs)  # x rounded as
        # round_activations(x, WIDE) rounds it


def int4_tiles(codes, scales_and_zeros):
    """few_rows.cpp's int4 column tiles (few_rows/columns.h) from the file's codes [N, K] (0..15) and bf16 (scale,
    zero) [K / g, N, 2]: codes [N / 16, K / 32, 256], where tile T's block b holds 4 quarters of 64 bytes, byte 4c + j
    of quarter t the codes of column 16T + c at k = 32b + 8t + j (low nibble) and 32b + 8t + 4 + j (high nibble);
    factors [N / 16, K / g, 2, 16], per tile and group the 16 columns' scales, then their zeros (the file's values)."""
    n, k = codes.shape
    quads = codes.view(n // 16, 16, k // 32, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # tile, block, t, c, j, nibble
    tiles = (quads[..., 0] | quads[..., 1] << 4).reshape(n // 16, k // 32, 256)
    factors = scales_and_zeros.view(-1, n // 16, 16, 2).permute(1, 0, 3, 2)  # tile, group, (scale, zero), c
    return tiles, factors.contiguous()


class Int4Linear(quantize.Int4Linear):
    """int4 codes multiplied as integers, in column tiles: each input row rounded to 8 bits per block of 32
    (round_activations), 16 output columns' codes times 4 inputs in one instruction, exact integer sums, then each
    block's and group's factors (few_rows/columns.h). Every number of rows, a prompt's too: a tile is read once from
    memory for all of them."""

    replaces = {"forward": ("d90a8014854b3f47", "b3a53210"), "dequantize": ("9dd008f30553fd0b", "3bcffc29")}

    def rounds_inputs(self):
        return True

    def prepare(self, rows=1024):
        n, k = self.weight.shape[0], 2 * self.weight.shape[1]
        self.tiles = torch.empty(n // 16, k // 32, 256, dtype=torch.uint8)  # filled in place, a few rows at a time
        self.tile_factors = torch.empty(n // 16, k // self.groupsize, 2, 16, dtype=torch.bfloat16)
        for i in range(0, n, rows):
            self.tiles[i // 16:(i + rows) // 16], self.tile_factors[i // 16:(i + rows) // 16] = int4_tiles(
                mx.unpack(self.weight[i:i + rows], 4), self.scales_and_zeros[:, i:i + rows])
        read_once(self)

    def operands(self):
        return self.tiles, self.tile_factors, None

    def use_operands(self, tiles, tile_factors):
        self.tiles, self.tile_factors = tiles, tile_factors

    def forward(self, x):
        return linear(x, self.tiles, self.tile_factors, None, self.float_bias, self.outputs)  # x rounded as
        # round_activations rounds it


code_tables = {}


def code_table(fmt: mx.ElementFormat) -> torch.Tensor:
    """The values of a 6-bit format's 64 codes as bf16 (exact), one tensor per format (shared by stacked layers)."""
    if fmt.name not in code_tables:
        code_tables[fmt.name] = mx.decode_elements(torch.arange(64, dtype=torch.uint8), fmt).bfloat16()
    return code_tables[fmt.name]


def integer_table(fmt: mx.ElementFormat) -> torch.Tensor:
    """The 6-bit tiles' table: int16 [65], the 64 codes' values times the format's multiple, then log2 of it."""
    if ("integer", fmt.name) not in code_tables:
        multiple = fmt.integer_multiple
        values = (code_table(fmt).float() * multiple).short()
        log2_multiple = torch.tensor([multiple.bit_length() - 1], dtype=torch.short)
        code_tables["integer", fmt.name] = torch.cat([values, log2_multiple])
    return code_tables["integer", fmt.name]


def expand(codes, scales, fmt, rows=256):
    """Packed MX codes [N, K * bits / 8] and their E8M0 scales -> (values [N, K], a float32 factor per block of 32):
    exact int8 multiples (value * 8, * 2, * 64 for E2M3, E2M1, INT8) or bf16 (E3M2, E4M3)."""
    multiple = fmt.integer_multiple
    n, k = codes.shape[0], scales.shape[1] * mx.BLOCK
    # Filled in place a few rows at a time: no full float32 copy, and no result chunks interleaved with freed
    # temporaries on the heap (which keeps the heap from giving them back).
    values = torch.empty(n, k, dtype=torch.int8 if multiple else torch.bfloat16)
    for i in range(0, n, rows):
        v = mx.decode_elements(mx.unpack(codes[i:i + rows], fmt.bits), fmt)
        values[i:i + rows] = (v * multiple).round() if multiple else v
    return values, mx.scale_values(scales) / (multiple or 1)


class MXLinear(quantize.MXLinear):
    """OCP MX. The elements that are integer multiples (E2M3, E2M1, INT8: value * 8, * 2, * 64 within int8) multiply
    each input row rounded to 16 bits per block as integers, in column tiles (few_rows/columns.h): E2M3 as the file
    packs its codes, 6.25 bits per weight with the scales, on a CPU with AVX512_VBMI (a byte permute and a 64-word
    permute unpack them); elsewhere, and E2M1 and INT8, expanded to int8 at load (8 bits, plus a float32 factor per
    block). E3M2 with AVX512_VBMI and AVX512_BF16: packed codes through a bf16 table, times the inputs in bf16 pairs;
    else, and E4M3: expanded to bf16 at load (exact), times a float32 factor per block."""

    replaces = {"forward": ("af03a4058b2c0c9d", "37588596"), "dequantize": ("ae3abfd669e2d04d", "474422a4")}

    def rounds_inputs(self):  # packed 6-bit codes through a bf16 table round inputs to bf16, tiles to integers
        return self.tiles is not None or self.table is not None

    def prepare(self, rows=1024):
        self.tiles = self.tile_factors = self.values = self.block_factors = self.table = None
        n, k = self.weight.shape[0], self.scales.shape[1] * mx.BLOCK
        if self.fmt.integer_multiple and self.fmt.bits == 6 and torch.ops.few_rows.fp6_tiles_are_fast():
            self.tiles = torch.empty(whole_tiles(n) // 16, k // 32, 384, dtype=torch.uint8)
            for i in range(0, n, rows):
                part = fp6_tiles(mx.unpack(self.weight[i:i + rows], 6))
                self.tiles[i // 16:i // 16 + part.shape[0]] = part
            self.tile_factors, self.table = block_tiles(self.scales), integer_table(self.fmt)
        elif self.fmt.integer_multiple:
            self.tiles = torch.empty(whole_tiles(n) // 16, k // 32, 512, dtype=torch.int8)
            for i in range(0, n, rows):
                part = pair_tiles(expand(self.weight[i:i + rows], self.scales[i:i + rows], self.fmt)[0])
                self.tiles[i // 16:i // 16 + part.shape[0]] = part
            self.tile_factors = block_tiles(mx.scale_values(self.scales) / self.fmt.integer_multiple)
        elif self.fmt.bits == 6 and torch.ops.few_rows.packed_fp6_is_fast():
            self.table = code_table(self.fmt)
        else:
            self.values, self.block_factors = expand(self.weight, self.scales, self.fmt)
        read_once(self)

    def operands(self):  # tiles and their factors, the packed codes and their scales, or the expanded codes
        if self.tiles is not None:
            return self.tiles, self.tile_factors, self.table
        if self.table is not None:
            return self.weight, self.scales, self.table
        return self.values, self.block_factors, None

    def use_operands(self, weight, factors):
        if self.tiles is not None:
            self.tiles, self.tile_factors = weight, factors
        elif self.table is not None:
            self.weight, self.scales = weight, factors
        else:
            self.values, self.block_factors = weight, factors

    def forward(self, x):
        if self.tiles is not None:  # any number of rows; x rounded as round_activations(x, WIDE)
            return linear(x, self.tiles, self.tile_factors, self.table, self.float_bias, self.outputs)
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
