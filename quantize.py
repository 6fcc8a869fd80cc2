"""Weight-only quantization, offline: python quantize.py --checkpoint_path CKPT --mode MODE

Writes CKPT/model.MODE.safetensors with the mode in its metadata; generate.py maps it straight into the
quantized modules below. Every Linear is quantized, the LM head included (untied from the embedding, which
stays 16-bit: a decode step reads one row of it).

A format is declared once, by its record in FORMATS (Format: its mode, the code its kernels switch on, its module,
its MX elements). Its module keeps the file's layout and has one forward in plain PyTorch, valid on any device: the
reference. A backend serves it with kernels of its own (cpu/few_rows, gpu_kernels.py), proven against that forward in
the tests and by a spot check at load; a new format is its record and module here, its kernels and its tests.
"""
import cli

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import dataclasses
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mx
from checkpoint import InputError, OneLineErrors, map_safetensors, open_checkpoint, write_atomically
from model import Transformer, stacked

MX_MODES = {"mxfp8": "fp8_e4m3", "mxfp6": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2", "mxfp4": "fp4_e2m1",
            "mxint8": "int8"}
MODES = ("int8", "int4", "int4k", *MX_MODES)
INT4_GROUPSIZES = (32, 64, 128, 256)


# The reference forwards of int4 and MX dequantize a layer this many weight rows at a time: whole weights at once
# would hold a float32 copy of the largest layer, past loading's memory budget (tests/test_quantize.py).
ROWS = 1024


def rowwise_linear(x, dequantize, n):
    """F.linear(x, w) for the weight [n, K] that dequantize(rows) gives ROWS rows at a time."""
    return torch.cat([F.linear(x, dequantize(slice(i, i + ROWS)).to(x.dtype)) for i in range(0, n, ROWS)], -1)


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8: w = q * scale[n]. The forward is gpt-fast's: the codes cast to the input's
    dtype, times the scales after the product (torch.compile fuses the cast into the product)."""

    mode = "int8"

    def __init__(self, in_features, out_features, bias=False):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def forward(self, x):
        y = F.linear(round_activations(x, WIDE), self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def dequantize(self):
        return self.weight.float() * self.scales.float()[:, None]

    @staticmethod
    def quantize(w):
        w = w.float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-12).bfloat16()
        q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        return {"weight": q, "scales": scales}

    # What quantize.py, loading.py and tp.py ask of every format's module: the inputs that share a scale, the multiple
    # of output rows its kernels take, the axis of each tensor that runs along the outputs (stacking and slicing them
    # by output rows: loading.py, tp.py), its empty and quantized modules and its slices by inputs.
    out_multiple = 1
    OUTPUT_AXES = {"weight": 0, "scales": 0, "bias": 0}

    @staticmethod
    def block(groupsize):
        return 32  # the inputs that share an activation scale (round_activations)

    @classmethod
    def empty(cls, mode, in_features, out_features, bias, groupsize):
        return cls(in_features, out_features, bias)

    @classmethod
    def quantized(cls, mode, w, groupsize, rule):
        return cls.quantize(w)

    def keep_inputs(self, start, stop):  # a scale covers every input of its row; inputs are rounded per 32
        whole_blocks(start, stop, 32, "activation block")
        self.weight = self.weight[:, start:stop].contiguous()


# The levels of the inputs an int8 or integer MX product multiplies: 16 bits (8, as int4's, cost those formats
# +0.4-0.7% perplexity; docs/performance.md).
WIDE = 32767


def round_activations(x, levels=127):
    """The inputs an integer product multiplies: per block of 32 along the last dimension, q * d with
    d = max|x| / levels and q = round(x / d) in [-levels, levels]: 127 (llama.cpp's Q8_0 rounding) for int4, WIDE
    for int8 and the MX formats whose elements are integer multiples. The CPU backend's products of them are then
    exact integer sums; the reference forwards round the same way."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / levels
    q = torch.where(d > 0, blocks / d, 0).round()
    return (q * d).flatten(-2).to(x.dtype)


class Int4Linear(nn.Module):
    """Groupwise asymmetric int4, the layout of aten's CPU kernel: w = (q - 8) * scale + zero per group, two codes
    per byte (element 2i in the low nibble) and scales_and_zeros [K/g, N, 2]. Inputs are rounded to 8 bits per
    block of 32 (round_activations), as the CPU backend's integer products take them."""

    mode = "int4"

    def __init__(self, in_features, out_features, bias=False, groupsize=128):
        super().__init__()
        self.groupsize = groupsize
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // groupsize, out_features, 2,
                                                             dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def in_features(self):
        return 2 * self.weight.shape[1]

    out_features = Int8Linear.out_features

    def forward(self, x):
        y = rowwise_linear(round_activations(x), self.dequantize, self.weight.shape[0])
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def dequantize(self, rows=slice(None)):
        """The float32 weight (of these rows)."""
        scales, zeros = (t[:, rows].T.float()[:, :, None] for t in self.scales_and_zeros.unbind(-1))  # [n, K/g, 1]
        codes = mx.unpack(self.weight[rows], 4).float().sub_(8).unflatten(-1, (-1, self.groupsize))
        return codes.mul_(scales).add_(zeros).flatten(-2)

    @staticmethod
    def quantize(w, groupsize):
        groups = w.float().unflatten(1, (-1, groupsize))
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = ((hi - lo) / 15).clamp(min=1e-6).bfloat16()
        zeros = (lo + 8 * scales.float()).bfloat16()
        q = ((groups - lo.unsqueeze(-1)) / scales.float().unsqueeze(-1)).round().clamp(0, 15).flatten(1)
        return {"weight": mx.pack(q.to(torch.uint8), 4),
                "scales_and_zeros": torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()}

    out_multiple = 16  # aten's int4 kernel packs output rows in 16s
    OUTPUT_AXES = {"weight": 0, "scales_and_zeros": 1, "bias": 0}

    @staticmethod
    def block(groupsize):
        return groupsize

    @classmethod
    def empty(cls, mode, in_features, out_features, bias, groupsize):
        return cls(in_features, out_features, bias, groupsize)

    @classmethod
    def quantized(cls, mode, w, groupsize, rule):
        return cls.quantize(w, groupsize)

    def keep_inputs(self, start, stop):
        whole_blocks(start, stop, self.groupsize, "int4 group")
        self.weight = self.weight[:, start // 2:stop // 2].contiguous()
        self.scales_and_zeros = self.scales_and_zeros[start // self.groupsize:stop // self.groupsize].contiguous()


class Int4kLinear(nn.Module):
    """int4 in 4.625 bits a weight (int4's groups of 32 take 5): int4's codes, and per block of 32 an 8-bit scale and a
    signed 8-bit minimum, themselves scaled per 256 inputs by a bf16 pair (d, dmin), as llama.cpp's Q4_K scales its
    6-bit ones: w = code * (d * scale) + dmin * minimum. factors [N, ceil(K / 256), 20] bytes per row and 256
    inputs: d and dmin (bf16), the 8 blocks' scales, their minimums (a last, shorter super-block padded with
    zeros). Inputs are rounded as int4's."""

    mode = "int4k"
    SUPER = 256  # inputs that share a (d, dmin) pair

    def __init__(self, in_features, out_features, bias=False):
        super().__init__()
        supers = -(-in_features // self.SUPER)
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("factors", torch.empty(out_features, supers, 20, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    in_features = Int4Linear.in_features
    out_features = Int8Linear.out_features
    forward = Int4Linear.forward

    def dequantize(self, rows=slice(None)):
        """The float32 weight (of these rows): every factor exact in float32, each weight rounded once."""
        f = self.factors[rows]
        pair = f[..., :4].contiguous().view(torch.bfloat16).float()  # [n, supers, 2]
        blocks = self.weight.shape[1] // 16
        scales = (pair[..., :1] * f[..., 4:12]).flatten(1)[:, :blocks, None]
        minimums = (pair[..., 1:] * f[..., 12:20].contiguous().view(torch.int8)).flatten(1)[:, :blocks, None]
        codes = mx.unpack(self.weight[rows], 4).float().unflatten(-1, (-1, 32))
        return codes.mul_(scales).add_(minimums).flatten(-2)

    @classmethod
    def quantize(cls, w):
        """Each block's min-max scale and minimum, rounded to nearest on the 8-bit grids of its super-block's
        (d, dmin); the weights then coded against those. (Measured against the squared error's best of rounding each
        down or up, and against ranges never cut: both cost perplexity; docs/performance.md.)"""
        n, k = w.shape
        groups = w.float().unflatten(1, (-1, 32))
        lo, hi = groups.amin(-1), groups.amax(-1)
        blocks, supers = k // 32, -(-k // cls.SUPER)
        per_super = cls.SUPER // 32

        def by_super(t):  # [n, blocks] -> [n, supers, 8], zeros after the last block
            return F.pad(t, (0, supers * per_super - blocks)).view(n, supers, per_super)

        def by_block(codes, factor):  # codes [n, supers, 8] times the super-block's factor -> [n, blocks, 1]
            return (codes * factor.float()[..., None]).flatten(1)[:, :blocks, None]

        step = by_super((hi - lo) / 15)
        d = (step.amax(-1) / 255).clamp(min=1e-10).bfloat16()
        dmin = (by_super(lo.abs()).amax(-1) / 127).clamp(min=1e-10).bfloat16()
        scales = (step / d.float()[..., None]).round().clamp(1, 255)
        minimums = (by_super(lo) / dmin.float()[..., None]).round().clamp(-127, 127)
        offset = by_block(minimums, dmin)
        codes = ((groups - offset) / by_block(scales, d)).round().clamp(0, 15).flatten(1).to(torch.uint8)
        pair = torch.stack([d, dmin], -1).view(torch.uint8)  # [n, supers, 4]
        factors = torch.cat([pair, scales.to(torch.uint8), minimums.to(torch.int8).view(torch.uint8)], -1)
        return {"weight": mx.pack(codes, 4), "factors": factors}

    out_multiple = 16  # as int4's tiles
    OUTPUT_AXES = {"weight": 0, "factors": 0, "bias": 0}
    # int8's: in_features in whole blocks of 32 (a last super-block may be shorter), no mode, group or rule to take
    block, empty, quantized = (Int8Linear.__dict__[name] for name in ("block", "empty", "quantized"))

    def keep_inputs(self, start, stop):
        if start % self.SUPER or (stop % self.SUPER and stop != self.in_features):
            raise InputError(f"in_features [{start}, {stop}) would split a {self.SUPER}-element int4k super-block")
        self.weight = self.weight[:, start // 2:stop // 2].contiguous()
        self.factors = self.factors[:, start // self.SUPER:-(-stop // self.SUPER)].contiguous()


class MXLinear(nn.Module):
    """OCP MX: element codes densely packed along in_features (FP6 4 codes in 3 bytes, FP4 2 per byte), one E8M0
    scale per 32 of them."""

    def __init__(self, in_features, out_features, bias=False, mode="mxfp6"):
        super().__init__()
        self.mode, self.fmt = mode, mx.FORMATS[MX_MODES[mode]]
        self.register_buffer("weight", torch.empty(out_features, in_features * self.fmt.bits // 8, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, in_features // mx.BLOCK, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def in_features(self):
        return self.weight.shape[1] * 8 // self.fmt.bits

    out_features = Int8Linear.out_features

    def forward(self, x):
        if self.fmt.integer_multiple:  # inputs rounded to 16 bits per block, as int8's
            x = round_activations(x, WIDE)
        y = rowwise_linear(x, self.dequantize, self.weight.shape[0])
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def dequantize(self, rows=slice(None)):
        """The float32 weight (of these rows)."""
        return mx.dequantize(mx.unpack(self.weight[rows], self.fmt.bits), self.scales[rows], self.fmt)

    @staticmethod
    def quantize(w, fmt, rule, rows=4096):
        # in row chunks: the encoder's temporaries are ~40 bytes an element (a whole 150k-row head would take GBs)
        chunks = [mx.quantize(w[i:i + rows], mx.FORMATS[fmt], rule) for i in range(0, w.shape[0], rows)]
        return {"weight": mx.pack(torch.cat([c for c, _ in chunks]), mx.FORMATS[fmt].bits),
                "scales": torch.cat([s for _, s in chunks])}

    out_multiple = 1
    OUTPUT_AXES = Int8Linear.OUTPUT_AXES

    @staticmethod
    def block(groupsize):
        return mx.BLOCK

    @classmethod
    def empty(cls, mode, in_features, out_features, bias, groupsize):
        return cls(in_features, out_features, bias, mode)

    @classmethod
    def quantized(cls, mode, w, groupsize, rule):
        return cls.quantize(w, MX_MODES[mode], rule)

    def keep_inputs(self, start, stop):
        whole_blocks(start, stop, mx.BLOCK, "MX block")
        bits = self.fmt.bits  # 32 codes fill whole bytes in every format
        self.weight = self.weight[:, start * bits // 8:stop * bits // 8].contiguous()
        self.scales = self.scales[:, start // mx.BLOCK:stop // mx.BLOCK].contiguous()


def whole_blocks(start, stop, block, what):
    """Inputs [start, stop) of a layer for one tensor-parallel rank must not split a block that shares a scale."""
    if start % block or stop % block:
        raise InputError(f"in_features [{start}, {stop}) would split a {block}-element {what}")


@dataclasses.dataclass(frozen=True)
class Format:
    """A weight format, declared once. Read by quantize.py, loading.py and tp.py (its module: the file's tensors, the
    reference forward, how it slices and stacks), and by the backends: what they pass their kernels comes from here
    (the code the kernels switch on, the elements' values, the inputs' rounding), never from a guess."""
    mode: str  # --mode and the file's metadata ("plain": an nn.Linear of floats)
    code: int  # what cpu/few_rows/linear.h and gpu_kernels.py switch on (PLAIN, INT8, INT4, MX, INT4K)
    module: type  # its nn.Module
    element: mx.ElementFormat | None = None  # MX: the elements' format (its bits, its values, its integer multiple)
    levels: int | None = None  # the inputs rounded per block of 32 to these levels (round_activations), or as they are


PLAIN, INT8, INT4, MX, INT4K = range(5)
FORMATS = {"int8": Format("int8", INT8, Int8Linear, levels=WIDE), "int4": Format("int4", INT4, Int4Linear, levels=127),
           "int4k": Format("int4k", INT4K, Int4kLinear, levels=127),
           **{mode: Format(mode, MX, MXLinear, mx.FORMATS[e], WIDE if mx.FORMATS[e].integer_multiple else None)
              for mode, e in MX_MODES.items()}}
PLAIN_FORMAT = Format("plain", PLAIN, nn.Linear)
MODULES = (Int8Linear, Int4Linear, Int4kLinear, MXLinear)  # every format's module


def format_of(module) -> Format | None:
    """The format of a product module (an nn.Linear of floats: PLAIN_FORMAT), or None: not one of ours."""
    if type(module) is nn.Linear:
        return PLAIN_FORMAT
    return FORMATS[module.mode] if type(module) in MODULES else None


def factors_of(module) -> torch.Tensor | None:
    """What a product module's codes are multiplied by, as its file holds it (int8's and MX's scales, int4's scales and
    zeros, int4k's factors), or None (plain weights)."""
    return next((getattr(module, name) for name in ("scales", "scales_and_zeros", "factors") if hasattr(module, name)),
                None)


def output_axes(module) -> dict:
    """The axis of each of a product module's tensors that runs along its outputs."""
    return {"weight": 0, "bias": 0} if type(module) is nn.Linear else module.OUTPUT_AXES


def keep_outputs(module, index):
    """Keep the output rows `index` (a slice or indices) of a product module, in place; a slice of a mapped file stays
    a view of it."""
    for name, axis in output_axes(module).items():
        t = getattr(module, name)
        if t is not None:
            t = t[(slice(None),) * axis + (index,)].contiguous()
            setattr(module, name, nn.Parameter(t, requires_grad=False) if name in module._parameters else t)
    if isinstance(module, nn.Linear):
        module.out_features = module.weight.shape[0]
    elif module.out_features % module.out_multiple:
        raise InputError(f"{module.out_features} output features per rank; {module.mode} needs a multiple of "
                         f"{module.out_multiple}")


def stack_outputs(module, parts: list[dict]) -> dict:
    """The tensors of `module` (a product model.py stacks: model.stacked) from those of its parts as a file holds them:
    each tensor of the parts joined along its output axis."""
    axes = output_axes(module)
    return {name: torch.cat([p[name] for p in parts], axes[name]) for name in parts[0]}


def check_mode(mode, groupsize):
    if mode not in MODES:
        raise InputError(f"unsupported --mode '{mode}'; choose one of {', '.join(MODES)}")
    if mode == "int4" and groupsize not in INT4_GROUPSIZES:
        raise InputError(f"--groupsize {groupsize} is not supported for int4; use one of {INT4_GROUPSIZES}")


def file_mode(metadata: dict, path) -> tuple[str | None, int]:
    """The quantization a file written by this script declares in its metadata: (mode, block for replace_linears),
    or (None, 0) for a plain checkpoint."""
    mode = metadata.get("quantization")
    if not mode:
        return None, 0
    if mode not in MODES:
        raise InputError(f"{path}: unknown quantization '{mode}' in the metadata; re-run quantize.py")
    groupsize = metadata.get("groupsize", "128")
    if mode == "int4" and groupsize not in map(str, INT4_GROUPSIZES):
        raise InputError(f"{path}: groupsize '{groupsize}' in the metadata is not one of {INT4_GROUPSIZES}; re-run "
                         "quantize.py")
    return mode, int(groupsize) if mode == "int4" else 32


def block_of(mode, groupsize):
    return FORMATS[mode].module.block(groupsize)


def quantized_linear(mode, linear: nn.Linear, groupsize=128, name="") -> nn.Module:
    """An empty quantized module shaped like `linear` (on the current default device)."""
    n, k, bias = linear.out_features, linear.in_features, linear.bias is not None
    block, rows = block_of(mode, groupsize), FORMATS[mode].module.out_multiple
    if k % block or n % rows:
        raise InputError(f"{name}: in_features {k} / out_features {n} do not fit {mode} (in_features must be a "
                         f"multiple of {block}{f', out_features of {rows}' if rows > 1 else ''}); choose another mode")
    return FORMATS[mode].module.empty(mode, k, n, bias, groupsize)


def replace_linears(model, mode, groupsize=128):
    """Swap every Linear of the model for its quantized module, in place (works on the meta device)."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{parent_name}.{child_name}".lstrip(".")
                setattr(parent, child_name, quantized_linear(mode, child, groupsize, full))
    return model


def quantize_tensor(mode, w, groupsize, rule=None):
    """A weight [N, K] in `mode`'s tensors (rule None: the MX scale rule measured better for its elements, mx.py)."""
    return FORMATS[mode].module.quantized(mode, w, groupsize, rule or default_rule(mode))


def default_rule(mode) -> str:
    return mx.DEFAULT_RULE.get(MX_MODES.get(mode), "rceil")


def quantize_model(model, mode, groupsize=32, rule=None):
    """Quantize a loaded model's Linears in place, one at a time (each float weight is dropped as its layer is
    done); the LM head gets its own quantized copy, as quantize_checkpoint writes it. -> the model"""
    check_mode(mode, groupsize)
    rule = rule or default_rule(mode)
    model.args = dataclasses.replace(model.args, tie_embeddings=False)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                name = f"{parent_name}.{child_name}".lstrip(".")
                with torch.device("meta"):
                    module = quantized_linear(mode, child, groupsize, name)
                state = quantize_tensor(mode, child.weight.detach(), groupsize, rule)
                if child.bias is not None:
                    state["bias"] = child.bias.detach()
                module.load_state_dict(state, assign=True)
                setattr(parent, child_name, module)
    return model


def quantize_checkpoint(checkpoint_path, mode, groupsize=32, rule=None, output=None, progress=True,
                        written_for=None) -> Path:
    """Quantize one Linear at a time from the mapped source; write atomically. Returns the output path.
    written_for: a mark in the metadata for a file a tool wrote on its own ("draft": loading.load_draft's copy)."""
    from tqdm import tqdm

    check_mode(mode, groupsize)
    rule = rule or default_rule(mode)
    checkpoint = open_checkpoint(checkpoint_path)
    ckpt_dir, weights_path, args = checkpoint.directory, checkpoint.weights, checkpoint.args
    tensors, metadata = map_safetensors(weights_path)
    if metadata.get("quantization"):
        raise InputError(f"{weights_path}: already quantized ({metadata['quantization']}); quantize the "
                         "full-precision model.safetensors instead")
    output = cli.check_output_file(output or ckpt_dir / f"model.{mode}.safetensors", [weights_path],
                                   written_by_quantize)
    source_bytes = weights_path.stat().st_size
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        tensors = dict(tensors, **{"output.weight": tensors["tok_embeddings.weight"]})
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name in list(linears):  # the file holds the products model.py stacks apart
        for stack, parts in stacked(args).items():
            if name.endswith(f".{stack}.weight"):
                linears.remove(name)
                linears |= {name.replace(stack, part) for part, _ in parts}
    out = {}
    for name in tqdm(sorted(tensors), desc=f"quantize {mode}", disable=not progress, unit="tensor"):
        w = tensors[name]
        if name in linears:
            if not w.isfinite().all():
                raise InputError(f"{weights_path}: tensor '{name}' has NaN or Inf values; fix the checkpoint")
            module = name.removesuffix(".weight")
            quantized_linear(mode, nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"), groupsize, module)
            out.update({f"{module}.{key}": t.contiguous() for key, t in quantize_tensor(mode, w, groupsize, rule).items()})
        else:  # embeddings, norms, biases: 16-bit
            out[name] = w.to(torch.bfloat16).contiguous()
    meta = {"quantization": mode, "groupsize": str(groupsize if mode == "int4" else block_of(mode, groupsize)),
            "source": weights_path.name, "source_bytes": str(source_bytes)}
    if written_for:
        meta["written_for"] = written_for
    if mode in MX_MODES:
        meta.update(mx_element=MX_MODES[mode], mx_scale_rule=rule)
    from safetensors.torch import save_file
    write_atomically(output, lambda tmp: save_file(out, str(tmp), metadata=meta))
    return output


def written_by_quantize(path) -> bool:
    """Whether a file is a previous output of quantize.py (a safetensors file with a quantization in its metadata)."""
    try:
        return "quantization" in map_safetensors(path)[1]
    except InputError:
        return False


def current_copy(path, source, mode) -> bool:
    """Whether `path` is quantize.py's `mode` copy of `source` as it is now: named for it, of its size, and written
    after it (a file from before quantize.py recorded the size: name and time alone)."""
    try:
        metadata = map_safetensors(path)[1]
        size = metadata.get("source_bytes")
        return (metadata.get("quantization") == mode and metadata.get("source") == Path(source).name
                and (size is None or int(size) == Path(source).stat().st_size)
                and Path(path).stat().st_mtime >= Path(source).stat().st_mtime)
    except (InputError, OSError, ValueError):
        return False


def main(argv=None):
    parser = OneLineErrors(description="Quantize a checkpoint's Linear weights (weight-only, offline).")
    parser.add_argument("--checkpoint_path", required=True, help="checkpoint directory or its model.safetensors")
    parser.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    parser.add_argument("--groupsize", type=int, default=None, help=f"int4 group size, one of {INT4_GROUPSIZES} "
                        "(default 32)")
    parser.add_argument("--mx_scale_rule", choices=("rceil", "floor"), default=None,
                        help="MX scale rule (default: the one measured better for the element format, see mx.py)")
    parser.add_argument("--output", help="output file (default: CKPT/model.MODE.safetensors)")
    path = cli.run(quantize_flags, parser.parse_args(argv), on_interrupt="interrupted; nothing was written")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


def quantize_flags(args) -> Path:
    if args.groupsize is not None and args.mode != "int4":
        raise InputError(f"--groupsize applies to int4 only; drop it for --mode {args.mode}")
    if args.mx_scale_rule is not None and args.mode not in MX_MODES:
        raise InputError(f"--mx_scale_rule applies to the MX modes only; drop it for --mode {args.mode}")
    return quantize_checkpoint(args.checkpoint_path, args.mode, args.groupsize or 32, args.mx_scale_rule, args.output)


if __name__ == "__main__":
    main()
