"""quantize.py's quantizers against float64 references written here from each format's definition (int8
per-channel symmetric, int4 groupwise asymmetric, int4k's two-level factors, OCP MX through ml_dtypes' casts), with error bounds that a
wrong scale or zero point breaks: the tests at the end feed deliberately wrong quantizers to the same checks."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn

import mx
import quantize


def weight(rows=64, cols=1024, seed=0):
    """Rows of very different magnitudes, some offset from zero (so int4's zero points matter)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 4, (rows, 1), generator=g).float())
    return w + torch.randn(rows, 1, generator=g) * w.std(1, keepdim=True)


def dequantized(mode, tensors, w, groupsize=128):
    """The float weight quantize.py's own module reconstructs from the tensors."""
    module = quantize.quantized_linear(mode, nn.Linear(w.shape[1], w.shape[0], bias=False), groupsize)
    module.load_state_dict(tensors)
    return module.dequantize()[:].double()


# ------------------------------------------------------------------------------------------- int8

def check_int8(w, tensors):
    """w = q * s per output row, s = max|w| / 127 (stored in bf16), q = round(w / s) in [-127, 127]."""
    w64 = w.double()
    step = w64.abs().amax(1, keepdim=True) / 127
    assert ((tensors["scales"].double()[:, None] - step).abs() <= step * 2 ** -8).all(), "scale is not max|w| / 127"
    q = tensors["weight"].double()
    assert ((q >= -127) & (q <= 127)).all()
    w_hat = q * tensors["scales"].double()[:, None]
    assert torch.equal(dequantized("int8", tensors, w), w_hat)
    err = w64 - w_hat
    # rounding to the nearest step: half a step, the step itself off by bf16's rounding of the scale
    assert (err.abs() <= 0.5 * step * (1 + 2 ** -7)).all(), f"max error {(err.abs() / step).max():.3f} steps"
    assert abs((err / step).mean()) < 0.01, "the rounding is biased"


def test_int8_matches_its_definition():
    w = weight()
    check_int8(w, quantize.quantize_tensor("int8", w, None, None))


# ------------------------------------------------------------------------------------------- int4

def unpack_nibbles(packed):
    """Two 4-bit codes a byte, element 2i in the low nibble (aten's layout, as Int4Linear documents it)."""
    p = packed.numpy()
    codes = np.empty((p.shape[0], 2 * p.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4
    return torch.from_numpy(codes).double()


def check_int4(w, tensors, groupsize):
    """Per group of g inputs of a row: step s = (max - min) / 15, q = round((w - min) / s) in [0, 15], stored as
    w = (q - 8) * s + zero with zero = min + 8 s (s and zero in bf16)."""
    groups = w.double().unflatten(1, (-1, groupsize))
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    scales, zeros = (t.double().T.unsqueeze(-1) for t in tensors["scales_and_zeros"].unbind(-1))  # [N, K/g, 1]
    assert ((scales - step).abs() <= step * 2 ** -8).all(), "scale is not (max - min) / 15"
    q = unpack_nibbles(tensors["weight"]).unflatten(1, (-1, groupsize))
    w_hat = (q - 8) * scales + zeros
    assert ((dequantized("int4", tensors, w, groupsize) - w_hat.flatten(1)).abs() <= 1e-5 * step.repeat_interleave(
        groupsize, 1).flatten(1)).all()
    # the codes are the definition's rounding with the stored step (float32 may settle an exact tie otherwise)
    assert (q != ((groups - lo) / scales).round().clamp(0, 15)).double().mean() < 1e-3
    err = groups - w_hat
    # half a step; bf16's rounding of the step (<= 15 codes of it) and of the zero point
    bound = 0.5 * step * (1 + 2 ** -7) + (lo + 8 * step).abs() * 2 ** -8
    assert (err.abs() <= bound).all(), f"max error {(err.abs() / step).max():.3f} steps"
    assert abs((err / step).mean()) < 0.01, "the rounding is biased"


@pytest.mark.parametrize("groupsize", quantize.INT4_GROUPSIZES)
def test_int4_matches_its_definition(groupsize):
    w = weight(seed=groupsize)
    check_int4(w, quantize.quantize_tensor("int4", w, groupsize, None), groupsize)


def check_int4k(w, tensors):
    """Per block of 32 inputs of a row: s = (max - min) / 15 and the minimum rounded to nearest on the 8-bit grids of
    the row's super-block of 256, d = max s / 255 and dmin = max |min| / 127 (bf16; scale codes 1-255, minimum codes
    -127-127); the weights coded w = q * (d * scale) + dmin * minimum with q = round((w - offset) / step) in [0, 15]:
    within half a step, but where the rounded step or minimum cuts the block's range."""
    n, k = w.shape
    blocks, supers = k // 32, -(-k // 256)
    f = tensors["factors"]
    assert f.dtype == torch.uint8 and f.shape == (n, supers, 20)
    d, dmin = f[..., :4].contiguous().view(torch.bfloat16).double().unbind(-1)  # [N, supers]
    scales, minimums = f[..., 4:12].double(), f[..., 12:20].contiguous().view(torch.int8).double()
    groups = w.double().unflatten(1, (-1, 32))
    lo, hi = groups.amin(-1), groups.amax(-1)
    pad = supers * 8 - blocks
    s = torch.nn.functional.pad((hi - lo) / 15, (0, pad)).view(n, supers, 8)
    low = torch.nn.functional.pad(lo, (0, pad)).view(n, supers, 8)
    assert ((d - s.amax(-1) / 255).abs() <= s.amax(-1) / 255 * 2 ** -8).all(), "d is not max s / 255"
    assert ((dmin - low.abs().amax(-1) / 127).abs() <= low.abs().amax(-1) / 127 * 2 ** -8).all()
    for codes, value, limits in ((scales, s / d[..., None], (1, 255)), (minimums, low / dmin[..., None], (-127, 127))):
        assert ((codes - value.clamp(*limits)).abs() <= 0.5 + 1e-4).flatten(1)[:, :blocks].all(), "not the nearest"

    def blockwise(codes, factor):  # [N, supers, 8] codes -> [N, blocks, 1] values
        return (codes * factor[..., None]).flatten(1)[:, :blocks, None]
    step, offset = blockwise(scales, d), blockwise(minimums, dmin)
    q = unpack_nibbles(tensors["weight"]).unflatten(1, (-1, 32))
    w_hat = q * step + offset
    assert ((dequantized("int4k", tensors, w) - w_hat.flatten(1)).abs() <= 2 ** -23 * w_hat.abs().flatten(1)).all()
    inside = (groups >= offset) & (groups <= offset + 15 * step)
    assert ((groups - w_hat).abs() <= 0.5 * step * (1 + 1e-6))[inside].all(), "not rounded to the nearest code"
    assert (q[~inside] % 15 == 0).all(), "a weight outside the coded range not on its end"
    assert abs(((groups - w_hat) / step).mean()) < 0.01, "the rounding is biased"


def test_int4k_matches_its_definition():
    w = weight(cols=1024 - 64)  # three super-blocks and a shorter fourth one
    tensors = quantize.quantize_tensor("int4k", w, None, None)
    check_int4k(w, tensors)
    minimums = tensors["factors"][..., 12:20].view(torch.int8)
    shifted = tensors["factors"].clone()
    shifted[..., 12:20] = (minimums - 1).clamp(-127, 127).view(torch.uint8)  # a minimum a grid step lower
    with pytest.raises(AssertionError):
        check_int4k(w, dict(tensors, factors=shifted))


# ------------------------------------------------------------------------------------------- MX

# OCP MX v1.0: each element format's largest normal exponent (emax) and the cast that rounds into it
MX_ELEMENTS = {"mxfp8": (8, ml_dtypes.float8_e4m3fn), "mxfp6": (2, ml_dtypes.float6_e2m3fn),
               "mxfp6_e3m2": (4, ml_dtypes.float6_e3m2fn), "mxfp4": (2, ml_dtypes.float4_e2m1fn),
               "mxint8": (0, None)}  # MXINT8: 1.6 fixed point, steps of 1/64, kept symmetric in [-127, 127] / 64


def mx_reference(w, mode, rule):
    """Per block of 32: scale X = 2^(floor(log2 amax) - emax) (floor) or the smallest power of two with
    max_normal * X >= amax (rceil); elements cast to the format after clipping w / X to +-max_normal."""
    emax, dtype = MX_ELEMENTS[mode]
    max_normal = 127 / 64 if dtype is None else float(ml_dtypes.finfo(dtype).max)
    blocks = w.double().numpy().reshape(w.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    if rule == "floor":
        exp = np.floor(np.log2(amax)) - emax
    else:
        exp = np.ceil(np.log2(amax / max_normal))
    scale = np.exp2(np.clip(exp, -127, 127))
    scaled = np.clip(blocks / scale, -max_normal, max_normal)
    elements = np.round(scaled * 64) / 64 if dtype is None else scaled.astype(dtype).astype(np.float64)
    return torch.from_numpy((elements * scale).reshape(w.shape)), torch.from_numpy(scale.squeeze(-1))


def check_mx(w, tensors, mode, rule):
    reference, scale = mx_reference(w, mode, rule)
    assert torch.equal(torch.exp2(tensors["scales"].double() - 127), scale), "scales differ from the definition"
    assert torch.equal(dequantized(mode, tensors, w), reference)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("mode", MX_ELEMENTS)
def test_mx_matches_its_definition(mode, rule):
    w = weight(rows=32, cols=512)
    check_mx(w, quantize.quantize_tensor(mode, w, None, rule), mode, rule)


# ------------------------------------------------------------------------------------------- the checks bite

def test_a_wrong_quantizer_fails_the_checks():
    w, g = weight(), 128
    right = quantize.quantize_tensor("int4", w, g, None)
    scales, zeros = right["scales_and_zeros"].unbind(-1)
    for wrong_scales, wrong_zeros in [(scales, zeros + 0.5 * scales),  # zero point shifted by half a step
                                      (scales, zeros + 0.1 * scales),  # a tenth of a step: caught as a bias
                                      (scales * 1.05, zeros)]:  # scale 5% too large
        wrong = {"weight": right["weight"], "scales_and_zeros": torch.stack([wrong_scales, wrong_zeros], -1)}
        with pytest.raises(AssertionError):
            check_int4(w, wrong, g)
    # a quantizer that divides the range into 16 steps instead of 15
    groups = w.unflatten(1, (-1, g))
    lo = groups.amin(-1)
    step = (groups.amax(-1) - lo) / 16
    q = ((groups - lo.unsqueeze(-1)) / step.unsqueeze(-1)).round().clamp(0, 15).flatten(1).to(torch.uint8)
    sixteen = {"weight": mx.pack(q, 4),
               "scales_and_zeros": torch.stack([step, lo + 8 * step], -1).bfloat16().transpose(0, 1).contiguous()}
    with pytest.raises(AssertionError):
        check_int4(w, sixteen, g)
    right8 = quantize.quantize_tensor("int8", w, None, None)
    with pytest.raises(AssertionError):
        check_int8(w, {"weight": right8["weight"], "scales": right8["scales"] * 1.02})
    off_by_one = (right8["weight"].int() + (torch.rand(w.shape) < 0.01)).clamp(-127, 127).to(torch.int8)
    with pytest.raises(AssertionError):
        check_int8(w, {"weight": off_by_one, "scales": right8["scales"]})
    mx4 = quantize.quantize_tensor("mxfp4", w, None, "rceil")
    with pytest.raises(AssertionError):  # a scale one power of two off
        check_mx(w, {"weight": mx4["weight"], "scales": mx4["scales"] + 1}, "mxfp4", "rceil")
    with pytest.raises(AssertionError):  # the other rule's codes
        check_mx(w, quantize.quantize_tensor("mxfp4", w, None, "floor"), "mxfp4", "rceil")
