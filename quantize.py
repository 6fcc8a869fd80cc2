"""Weight-only quantization, offline: python quantize.py --checkpoint_path CKPT --mode MODE

Writes CKPT/model.MODE.safetensors with the mode in its metadata; generate.py maps it straight into the
quantized modules below. Every Linear is quantized, the LM head included (untied from the embedding, which
stays 16-bit: a decode step reads one row of it).

A step with a few rows on CPU (decode, draft, verify) never materializes a full-precision weight: few_rows.cpp
(see model.py) converts int8 codes to float in registers, times the per-channel scale; 6-bit MX codes it reads
packed, as the file has them, where the CPU unpacks them in vector code, and other MX codes expanded once at load
(see MXLinear), times their block factors; int4 codes it multiplies as integers with the inputs rounded to 8 bits
(round_activations), then applies the group's scale and offset. Calls with many rows (prefill, eval) decode one
layer at a time into a temporary weight (packed 6-bit codes: 16 rows at a time through few_rows.cpp); int8 and
int4 without few_rows.cpp call aten's packed kernels.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mx
from model import FEW_ROWS, InputError, build_few_rows_kernels, few_rows, few_rows_linear, many_rows_linear

MX_MODES = {"mxfp8": "fp8_e4m3", "mxfp6": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2", "mxfp4": "fp4_e2m1",
            "mxint8": "int8"}
MODES = ("int8", "int4", *MX_MODES)
INT4_GROUPSIZES = (32, 64, 128, 256)
# aten's packed int8/int4 CPU kernels are built for a few rows: on a 1536 x 576 layer at 150 rows they took
# 95 / 162 ms where decoding the layer's weight and calling the GEMM took 1.8 ms, so longer inputs do that.
# (At 5-16 rows the decode + GEMM was also 13-25x faster on this layer; the decode step keeps the kernels
# because there it would write a full-precision weight per layer per step.)
PACKED_KERNEL_MAX_ROWS = 16


def select_bias(module, index):
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias[index].contiguous(), requires_grad=False)


def check_whole_blocks(start, stop, block, what):
    if start % block or stop % block:
        raise InputError(f"in_features [{start}, {stop}) would split a {block}-element {what}")


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8: w = q * scale[n]."""

    def __init__(self, in_features, out_features, bias=False):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scale_factors = None

    def prepare(self):
        # float32 once at load: converting per call costs a kernel launch per layer per step (~2 ms of a 12 ms step)
        self.scale_factors = self.scales.float()

    def forward(self, x):
        if few_rows(x, self.weight):
            y = few_rows_linear(x, self.weight, self.scale_factors)
        elif x.numel() > PACKED_KERNEL_MAX_ROWS * x.shape[-1]:
            y = many_rows_linear(x, self.dequantize())
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight,
                                                  self.scales.to(x.dtype)).view(*x.shape[:-1], -1)
        y = y if self.bias is None else y + self.bias.float()
        return y.to(x.dtype)

    def dequantize(self):
        return self.weight.float() * self.scales.float()[:, None]

    def few_rows_operands(self):  # model.FusedProducts
        return self.weight, self.scale_factors

    def use_operands(self, weight, factors):
        self.weight, self.scale_factors = weight, factors

    # Tensor parallelism (tp.py): a scale belongs to its output row, and covers every input of it.
    def select_outputs(self, index):
        self.weight, self.scales = self.weight[index].contiguous(), self.scales[index].contiguous()
        select_bias(self, index)

    def select_inputs(self, start, stop):
        self.weight = self.weight[:, start:stop].contiguous()

    @staticmethod
    def quantize(w):
        w = w.float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-12).bfloat16()
        q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        return {"weight": q, "scales": scales}


def round_activations(x):
    """The inputs an int4 product multiplies: per block of 32 along the last dimension, q * d with d = max|x| / 127
    and q = round(x / d) in [-127, 127] (llama.cpp's Q8_0 rounding), so that few_rows.cpp's int4 products are
    integer dot products. few_rows.cpp rounds its rows itself; every other path takes them from here."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / d, 0).round()
    return (q * d).flatten(-2).to(x.dtype)


def int4_runtime(codes, scales_and_zeros):
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


class Int4Linear(nn.Module):
    """Groupwise asymmetric int4, the layout of aten's CPU kernel: w = (q - 8) * scale + zero per group.
    On disk: two codes per byte (element 2i in the low nibble) and scales_and_zeros [K/g, N, 2]. At load
    (`prepare`, a few rows at a time) the codes are rearranged for few_rows.cpp, which takes a few rows
    (decode, draft, verify) reading 4 bits + 64 / g per weight; without it, aten's packed kernel. Inputs are
    rounded to 8 bits per block of 32 on every path (round_activations), so that few_rows.cpp multiplies
    integers: over SmolLM2's 211 products (g = 32, 2 threads, Zen 3) 8.6 ms at one row, against 11.3 for
    converting the codes to float and 12.2 for the int8 layout; aten's kernel took 14.4 ms for a whole 1-row
    step and a verify at 5 rows cost it 2.3 decode steps."""

    def __init__(self, in_features, out_features, bias=False, groupsize=128):
        super().__init__()
        self.groupsize = groupsize
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // groupsize, out_features, 2,
                                                             dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.nibbles = self.group_factors = self.packed = None

    def prepare(self, rows=1024):
        chunks = range(0, self.weight.shape[0], rows)
        if build_few_rows_kernels():  # filled in place, as MXLinear.prepare
            n, k = self.weight.shape[0], 2 * self.weight.shape[1]
            self.nibbles = torch.empty(n, k // 2, dtype=torch.uint8)
            self.group_factors = torch.empty(n, k // self.groupsize, 2)
            for i in chunks:
                self.nibbles[i:i + rows], self.group_factors[i:i + rows] = int4_runtime(
                    mx.unpack(self.weight[i:i + rows], 4), self.scales_and_zeros[:, i:i + rows])
        else:
            self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                mx.unpack(self.weight[i:i + rows], 4).int(), 1) for i in chunks])

    def few_rows_operands(self):  # model.FusedProducts
        return None if self.nibbles is None else (self.nibbles, self.group_factors)

    def use_operands(self, nibbles, group_factors):
        self.nibbles, self.group_factors = nibbles, group_factors

    def forward(self, x):
        if self.nibbles is not None and few_rows(x, self.nibbles):
            y = few_rows_linear(x, self.nibbles, self.group_factors)  # rounds x as round_activations does
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        x = round_activations(x)
        if self.packed is not None and x.numel() <= PACKED_KERNEL_MAX_ROWS * x.shape[-1]:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed, self.groupsize,
                                                          self.scales_and_zeros.to(x.dtype))
            y = y.view(*x.shape[:-1], -1)
        else:
            y = many_rows_linear(x, self.dequantize())
        return y if self.bias is None else y + self.bias.to(x.dtype)

    # Tensor parallelism (tp.py): groups run along in_features and are never split.
    def select_outputs(self, index):
        self.weight = self.weight[index].contiguous()
        self.scales_and_zeros = self.scales_and_zeros[:, index].contiguous()
        select_bias(self, index)
        if self.weight.shape[0] % 16:
            raise InputError(f"{self.weight.shape[0]} output features per rank; aten's int4 kernel needs a multiple of 16")

    def select_inputs(self, start, stop):
        check_whole_blocks(start, stop, self.groupsize, "int4 group")
        self.weight = self.weight[:, start // 2:stop // 2].contiguous()
        self.scales_and_zeros = self.scales_and_zeros[start // self.groupsize:stop // self.groupsize].contiguous()

    def dequantize(self, codes=None):
        codes = mx.unpack(self.weight if codes is None else codes, 4).float() - 8
        scales, zeros = (t.float().T.repeat_interleave(self.groupsize, 1) for t in self.scales_and_zeros.unbind(-1))
        return codes * scales + zeros

    @staticmethod
    def quantize(w, groupsize):
        groups = w.float().unflatten(1, (-1, groupsize))
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = ((hi - lo) / 15).clamp(min=1e-6).bfloat16()
        zeros = (lo + 8 * scales.float()).bfloat16()
        q = ((groups - lo.unsqueeze(-1)) / scales.float().unsqueeze(-1)).round().clamp(0, 15).flatten(1)
        return {"weight": mx.pack(q.to(torch.uint8), 4),
                "scales_and_zeros": torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()}


# Element formats whose every value is an integer multiple of 1/MULTIPLE with |value * MULTIPLE| <= 127.
INT8_EXACT = {"fp6_e2m3": 8, "fp4_e2m1": 2, "int8": 64}


_code_tables = {}


def code_table(fmt: mx.ElementFormat) -> torch.Tensor:
    """The values of a 6-bit format's 64 codes as bf16 (exact), one tensor per format (model.FusedProducts)."""
    if fmt.name not in _code_tables:
        _code_tables[fmt.name] = mx.decode_elements(torch.arange(64, dtype=torch.uint8), fmt).bfloat16()
    return _code_tables[fmt.name]


class MXLinear(nn.Module):
    """OCP MX: element codes densely packed along in_features, one E8M0 scale per 32 of them.

    The file keeps the dense packing. A few rows at a time (decode, draft, verify) on a CPU with AVX512_VBMI and
    AVX512_BF16, few_rows.cpp reads 6-bit codes (E2M3, E3M2) as they are, 6.25 bits per weight with the scales:
    SmolLM2's mxfp6 products 4.37 ms against 4.95-5.01 with the codes expanded to int8 (Zen 4, 1 row). Elsewhere,
    and for the other formats, `prepare` expands the codes once at load: E2M3, E2M1 and INT8 to exact int8
    multiples (value * 8, * 2, * 64), E3M2 and E4M3 to bf16 (exact), with one float32 factor per block, which
    few_rows.cpp multiplies in; a step then reads 8 (or 16) bits per weight plus 1 for the factors. (Unpacking in
    plain vector code did not pay: FP4 expanded in registers by a 16-entry byte shuffle, over SmolLM2's products
    on 2 AVX2 cores, 12.3 / 20.3 ms at 1 / 5 rows against 10.6 / 17.0 for the int8 expansion.)
    """

    def __init__(self, in_features, out_features, bias=False, fmt="fp6_e2m3"):
        super().__init__()
        self.fmt = mx.FORMATS[fmt]
        self.register_buffer("weight", torch.empty(out_features, in_features * self.fmt.bits // 8, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, in_features // mx.BLOCK, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.values = self.block_factors = self.table = None

    def prepare(self):
        if (self.fmt.bits == 6 and self.weight.device.type == "cpu" and build_few_rows_kernels()
                and torch.ops.few_rows.packed_fp6_is_fast()):
            self.table = code_table(self.fmt)
        else:
            self.expand()

    def expand(self, rows=256):
        fmt, multiple = self.fmt, INT8_EXACT.get(self.fmt.name)
        n, k = self.weight.shape[0], self.scales.shape[1] * mx.BLOCK
        # Filled in place a few rows at a time: no full float32 copy, and no result chunks interleaved with freed
        # temporaries on the heap (concatenated chunks left SmolLM2 mxfp6 at +462 MiB after loading, +388 this way).
        self.values = torch.empty(n, k, dtype=torch.int8 if multiple else torch.bfloat16)
        for i in range(0, n, rows):
            v = mx.decode_elements(mx.unpack(self.weight[i:i + rows], fmt.bits), fmt)
            self.values[i:i + rows] = (v * multiple).round() if multiple else v
        self.block_factors = mx.scale_values(self.scales) / (multiple or 1)

    # Tensor parallelism (tp.py): blocks run along in_features and are never split.
    def select_outputs(self, index):
        self.weight, self.scales = self.weight[index].contiguous(), self.scales[index].contiguous()
        select_bias(self, index)

    def select_inputs(self, start, stop):
        check_whole_blocks(start, stop, mx.BLOCK, "MX block")
        bits = self.fmt.bits  # 32 codes fill whole bytes in every format
        self.weight = self.weight[:, start * bits // 8:stop * bits // 8].contiguous()
        self.scales = self.scales[:, start // mx.BLOCK:stop // mx.BLOCK].contiguous()

    def runtime_weight(self):
        """[N, K] float32 from the expanded codes (expand); fused into the product's reduction when compiled."""
        factors = self.block_factors.repeat_interleave(mx.BLOCK, -1)
        return self.values.float() * factors

    # model.FusedProducts: the packed codes and their scales, or the expanded codes and their factors.
    def few_rows_operands(self):
        return (self.weight, self.scales) if self.table is not None else (self.values, self.block_factors)

    def use_operands(self, weight, factors):
        if self.table is not None:
            self.weight, self.scales = weight, factors
        else:
            self.values, self.block_factors = weight, factors

    def forward(self, x):
        # Packed codes: few_rows.cpp, FEW_ROWS rows at a time (a 130-token SmolLM2 prompt: 0.41 s; int8 0.38).
        if self.table is not None:
            parts = [few_rows_linear(part, self.weight, self.scales, self.table)
                     for part in x.reshape(-1, x.shape[-1]).split(FEW_ROWS)]
            y = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(*x.shape[:-1], -1)
        elif few_rows(x, self.values):  # decode, draft, verify
            y = few_rows_linear(x, self.values, self.block_factors)
        else:  # many rows (prefill, eval), or no few_rows.cpp: decode this layer into a temporary weight
            y = F.linear(x.float(), self.runtime_weight())
        y = y if self.bias is None else y + self.bias.float()
        return y.to(x.dtype)

    @staticmethod
    def quantize(w, fmt, rule):
        codes, scales = mx.quantize(w, mx.FORMATS[fmt], rule)
        return {"weight": mx.pack(codes, mx.FORMATS[fmt].bits), "scales": scales}


def check_mode(mode, groupsize):
    if mode not in MODES:
        raise InputError(f"unsupported --mode '{mode}'; choose one of {', '.join(MODES)}")
    if mode == "int4" and groupsize not in INT4_GROUPSIZES:
        raise InputError(f"--groupsize {groupsize} is not supported for int4; use one of {INT4_GROUPSIZES}")


def block_of(mode, groupsize):
    return groupsize if mode == "int4" else mx.BLOCK if mode in MX_MODES else 1


def quantized_linear(mode, linear: nn.Linear, groupsize=128, name="") -> nn.Module:
    """An empty quantized module shaped like `linear` (on the current default device)."""
    n, k, bias = linear.out_features, linear.in_features, linear.bias is not None
    block = block_of(mode, groupsize)
    if k % block or (mode == "int4" and n % 16):
        raise InputError(f"{name}: in_features {k} / out_features {n} do not fit {mode} (in_features must be a "
                         f"multiple of {block}{', out_features of 16' if mode == 'int4' else ''}); choose another mode")
    if mode == "int8":
        return Int8Linear(k, n, bias)
    if mode == "int4":
        return Int4Linear(k, n, bias, groupsize)
    return MXLinear(k, n, bias, MX_MODES[mode])


def replace_linears(model, mode, groupsize=128):
    """Swap every Linear of the model for its quantized module, in place (works on the meta device)."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{parent_name}.{child_name}".lstrip(".")
                setattr(parent, child_name, quantized_linear(mode, child, groupsize, full))
    return model


def quantize_tensor(mode, w, groupsize, rule):
    if mode == "int8":
        return Int8Linear.quantize(w)
    if mode == "int4":
        return Int4Linear.quantize(w, groupsize)
    return MXLinear.quantize(w, MX_MODES[mode], rule)


def quantize_checkpoint(checkpoint_path, mode, groupsize=32, rule=None, output=None, progress=True) -> Path:
    """Quantize one Linear at a time from the mapped source; write atomically. Returns the output path."""
    from tqdm import tqdm
    from generate import map_safetensors, resolve_checkpoint
    from model import ModelArgs, Transformer

    check_mode(mode, groupsize)
    rule = rule or mx.DEFAULT_RULE.get(MX_MODES.get(mode), "rceil")
    ckpt_dir, weights_path = resolve_checkpoint(checkpoint_path)
    args = ModelArgs.from_config(ckpt_dir / "config.json")
    tensors, metadata = map_safetensors(weights_path)
    if metadata.get("quantization"):
        raise InputError(f"{weights_path}: already quantized ({metadata['quantization']}); quantize the "
                         "full-precision model.safetensors instead")
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        tensors = dict(tensors, **{"output.weight": tensors["tok_embeddings.weight"]})
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    out = {}
    for name in tqdm(sorted(tensors), desc=f"quantize {mode}", disable=not progress, unit="tensor"):
        w = tensors[name]
        if name in linears:
            if not w.float().isfinite().all():
                raise InputError(f"{weights_path}: tensor '{name}' has NaN or Inf values; fix the checkpoint")
            module = name.removesuffix(".weight")
            quantized_linear(mode, nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"), groupsize, module)
            out.update({f"{module}.{key}": t.contiguous() for key, t in quantize_tensor(mode, w, groupsize, rule).items()})
        else:  # embeddings, norms, biases: 16-bit
            out[name] = w.to(torch.bfloat16).contiguous()
    output = Path(output) if output else ckpt_dir / f"model.{mode}.safetensors"
    meta = {"quantization": mode, "groupsize": str(groupsize if mode == "int4" else block_of(mode, groupsize)),
            "source": weights_path.name}
    if mode in MX_MODES:
        meta.update(mx_element=MX_MODES[mode], mx_scale_rule=rule)
    from safetensors.torch import save_file
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(out, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def main(argv=None):
    from generate import OneLineErrors
    parser = OneLineErrors(description="Quantize a checkpoint's Linear weights (weight-only, offline).")
    parser.add_argument("--checkpoint_path", required=True, help="checkpoint directory or its model.safetensors")
    parser.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    parser.add_argument("--groupsize", type=int, default=None, help=f"int4 group size, one of {INT4_GROUPSIZES} "
                        "(default 32)")
    parser.add_argument("--mx_scale_rule", choices=("rceil", "floor"), default=None,
                        help="MX scale rule (default: the one measured better for the element format, see mx.py)")
    parser.add_argument("--output", help="output file (default: CKPT/model.MODE.safetensors)")
    args = parser.parse_args(argv)
    try:
        if args.groupsize is not None and args.mode != "int4":
            raise InputError(f"--groupsize applies to int4 only; drop it for --mode {args.mode}")
        if args.mx_scale_rule is not None and args.mode not in MX_MODES:
            raise InputError(f"--mx_scale_rule applies to the MX modes only; drop it for --mode {args.mode}")
        path = quantize_checkpoint(args.checkpoint_path, args.mode, args.groupsize or 32, args.mx_scale_rule,
                                   args.output)
    except InputError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
