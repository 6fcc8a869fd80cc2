"""OCP Microscaling (MX) formats: element codes, E8M0 block scales, dense packing.

A block is 32 consecutive elements along the reduction dimension (a Linear's in_features) sharing one E8M0
scale 2^(code - 127). Elements round to nearest, ties to even, and saturate at the format's largest normal.

Scale rule. The spec's FLOOR rule, 2^(floor(log2 amax) - emax), can push the block maximum past the largest
normal, where it saturates (FP4: 7.9 -> 6). RCEIL, 2^ceil(log2(amax / max_normal)), never saturates but spends
up to one bit of range. Neither wins everywhere. Perplexity of SmolLM2-135M on 40 HumanEval tasks
(scripts/eval_ppl.py; bf16 5.114), floor vs rceil: MXFP8 E4M3 5.339 vs 5.263, MXFP6 E2M3 5.284 vs 5.276,
MXFP4 12.23 vs 13.93, MXINT8 5.133 vs 5.138. So the default is per format, the measured winner (DEFAULT_RULE;
E5M2 and E3M2 follow their lower relative weight error: rceil); quantize.py records the rule
in the file's metadata and --mx_scale_rule overrides it.
"""
import math
from dataclasses import dataclass

import torch

BLOCK = 32
SCALE_NAN = 0xFF


@dataclass(frozen=True)
class ElementFormat:
    name: str
    bits: int
    ebits: int  # 0 for MXINT8
    mbits: int
    nan_codes: tuple = ()  # non-negative codes that mean NaN (or Inf): they are never produced by encode

    @property
    def bias(self):
        return (1 << (self.ebits - 1)) - 1 if self.ebits else 0

    @property
    def values(self) -> torch.Tensor:
        """Value of every non-negative code, 0 .. 2^(bits-1)-1, in code order (ascending); NaN codes are NaN."""
        return self.table()

    def table(self, device=None) -> torch.Tensor:
        """values, built on `device` (the codes' device: a table on the CPU cannot index CUDA codes; in a compiled
        graph it is a constant)."""
        codes = torch.arange(1 << (self.bits - 1), dtype=torch.float64, device=device)
        if not self.ebits:  # two's complement integer with an implicit 2^-6
            return (codes / 64).float()
        exp, man = codes.div(1 << self.mbits, rounding_mode="floor"), codes.remainder(1 << self.mbits)
        normal = torch.exp2(exp - self.bias) * (1 + man / (1 << self.mbits))
        subnormal = 2.0 ** (1 - self.bias) * man / (1 << self.mbits)
        values = torch.where(exp == 0, subnormal, normal)
        nan = codes >= (1 << (self.bits - 1)) - len(self.nan_codes)  # NaN codes are the highest
        return values.masked_fill(nan, float("nan")).float()

    @property
    def max_normal(self) -> float:
        """The largest value that is not NaN (plain Python: no tensor, so no device and no sync)."""
        code = (1 << (self.bits - 1)) - 1 - len(self.nan_codes)  # NaN codes are the highest
        if not self.ebits:
            return code / 64
        exp, man = code >> self.mbits, code & ((1 << self.mbits) - 1)
        return 2.0 ** (exp - self.bias) * (1 + man / (1 << self.mbits))

    @property
    def integer_multiple(self) -> int | None:
        """The power of two M that makes every value an integer of at most 127 in magnitude (E2M3: 8, E2M1: 2, INT8:
        64), or None (E3M2, E4M3, E5M2): the elements the CPU backend multiplies as integers."""
        multiple = 64 if not self.ebits else 2 ** (self.bias + self.mbits - 1)
        return multiple if self.max_normal * multiple <= 127 else None

    @property
    def emax(self) -> int:
        """Exponent of the largest normal, the spec's emax_elem."""
        return math.frexp(self.max_normal)[1] - 1


FORMATS = {
    "fp8_e4m3": ElementFormat("fp8_e4m3", 8, 4, 3, nan_codes=(0x7F,)),
    "fp8_e5m2": ElementFormat("fp8_e5m2", 8, 5, 2, nan_codes=(0x7C, 0x7D, 0x7E, 0x7F)),  # Inf, NaN, NaN, NaN
    "fp6_e2m3": ElementFormat("fp6_e2m3", 6, 2, 3),
    "fp6_e3m2": ElementFormat("fp6_e3m2", 6, 3, 2),
    "fp4_e2m1": ElementFormat("fp4_e2m1", 4, 2, 1),
    "int8": ElementFormat("int8", 8, 0, 6),
}
DEFAULT_RULE = {"fp8_e4m3": "rceil", "fp8_e5m2": "rceil", "fp6_e2m3": "rceil", "fp6_e3m2": "rceil",
                "fp4_e2m1": "floor", "int8": "floor"}


def encode_elements(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """float32 values (already divided by the scale; not NaN) -> codes (uint8): nearest, ties to even, saturating."""
    x = x.float()
    if not fmt.ebits:
        return (x * 64).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    mag = x.abs().clamp(max=fmt.max_normal)  # the largest value that is not NaN
    # In the binade of exponent e (the subnormals share the smallest normal's), values are steps of 2^(e - mbits):
    # mag in steps, rounded half to even, is the code's mantissa (2^mbits more for normals). Power-of-two scaling and
    # rounding to an integer are exact in float32, so this is the nearest value, ties to the even code.
    lowest = 1 - fmt.bias
    exp = torch.frexp(mag.clamp(min=2.0 ** lowest)).exponent.sub_(1)
    step = (fmt.mbits - exp + 127).bitwise_left_shift_(23).view(torch.float32)  # 1 / 2^(e - mbits), a normal float
    steps = mag.mul_(step).round_()  # 0 .. 2^(mbits + 1): the top one is the next binade's first
    code = steps.to(torch.int32).add_((exp - lowest) << fmt.mbits).to(torch.uint8)
    sign = (x < 0) & (code > 0)
    return code | (sign.to(torch.uint8) << (fmt.bits - 1))


def decode_elements(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """codes (uint8) -> float32 values."""
    if not fmt.ebits:
        return codes.view(torch.int8).float() / 64
    # The code's exponent and mantissa bits placed as bf16's (a subnormal code is a bf16 subnormal), times
    # 2^(127 - bias): the exact value, at a third of a table lookup's time on a CPU.
    c = codes.to(torch.int16, copy=True)
    sign = (c >> (fmt.bits - 1)).bitwise_left_shift_(15)
    magnitude = c.bitwise_and_((1 << (fmt.bits - 1)) - 1)
    nan = magnitude >= (1 << (fmt.bits - 1)) - len(fmt.nan_codes) if fmt.nan_codes else None  # the highest codes
    bits = magnitude.bitwise_left_shift_(7 - fmt.mbits).bitwise_or_(sign)
    values = bits.view(torch.bfloat16).float().mul_(2.0 ** (127 - fmt.bias))
    return values if nan is None else values.masked_fill_(nan, float("nan"))


def block_scales(amax: torch.Tensor, fmt: ElementFormat, rule: str = "rceil") -> torch.Tensor:
    """E8M0 codes (uint8) for blocks with the given absolute maxima (float32)."""
    if rule == "floor":
        exp = torch.frexp(amax).exponent - 1 - fmt.emax  # exact: taken from the float bits, not from log2
    elif rule == "rceil":  # smallest e with max_normal * 2^e >= amax, found with exact power-of-two products
        exp = torch.frexp(amax / fmt.max_normal).exponent
        max_normal = torch.full_like(amax, fmt.max_normal)
        exp = exp + (torch.ldexp(max_normal, exp) < amax).int()
        exp = exp - (torch.ldexp(max_normal, exp - 1) >= amax).int()
    else:
        raise ValueError(f"unknown MX scale rule '{rule}': use 'rceil' or 'floor'")
    code = (exp + 127).clamp(0, 254)
    code = torch.where(amax == 0, 0, code)
    return torch.where(amax.isfinite(), code, SCALE_NAN).to(torch.uint8)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> float32 2^(code-127); 0xFF -> NaN."""
    values = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.int() - 127)
    return values.masked_fill(scales == SCALE_NAN, float("nan"))


def quantize(w: torch.Tensor, fmt: ElementFormat, rule: str = "rceil"):
    """w [..., K] with K a multiple of 32 -> (codes uint8 [..., K], scales uint8 [..., K/32])."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MX blocks need the reduction dimension to be a multiple of {BLOCK}, got {w.shape[-1]}")
    blocks = w.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1)
    amax = torch.where(blocks.isnan().any(-1), float("nan"), amax)
    scales = block_scales(amax, fmt, rule)
    exp = (scales.int() - 127).clamp(max=127).unsqueeze(-1)
    inverse = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), -exp)  # per block: ldexp per element is slow
    codes = encode_elements((blocks * inverse).nan_to_num(0), fmt)  # exact: a power-of-two divide
    return codes.flatten(-2), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    values = decode_elements(codes, fmt).unflatten(-1, (-1, BLOCK))
    return (values * scale_values(scales).unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------- dense packing along the last dimension

def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """FP4: 2 codes per byte, element 2i in the low nibble. FP6: 4 codes in 3 bytes, little-endian,
    element 4i in the lowest 6 bits. 8-bit codes are stored as they are."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if bits == 4:
        pairs = codes.unflatten(-1, (-1, 2))
        return pairs[..., 0] | (pairs[..., 1] << 4)
    if bits == 6:  # byte by byte: a 24-bit word in int32 would move 4 times the bytes
        c = codes.unflatten(-1, (-1, 4)).unbind(-1)
        return torch.stack([c[0] | (c[1] << 6), (c[1] >> 2) | (c[2] << 4), (c[2] >> 4) | (c[3] << 2)], -1).flatten(-2)
    raise ValueError(f"no packing for {bits}-bit codes")


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    if bits == 4:
        return torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)
    if bits == 6:
        b = packed.unflatten(-1, (-1, 3)).unbind(-1)
        return torch.stack([b[0] & 0x3F, (b[0] >> 6) | ((b[1] & 0xF) << 2), (b[1] >> 4) | ((b[2] & 0x3) << 4), b[2] >> 2],
                           -1).flatten(-2)
    raise ValueError(f"no packing for {bits}-bit codes")
