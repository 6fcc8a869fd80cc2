"""mx.py: exact element codes, scale rules and packing, checked against ml_dtypes (an independent cast)."""
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import mx

ML_DTYPES = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
             "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
             "fp4_e2m1": ml_dtypes.float4_e2m1fn}


@pytest.mark.parametrize("name", mx.FORMATS)
def test_every_code_round_trips(name):
    fmt = mx.FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.int32).to(torch.uint8)
    values = mx.decode_elements(codes, fmt)
    finite = ~values.isnan()
    negative_zero = (values == 0) & (codes >= (1 << (fmt.bits - 1)))  # -0 encodes as +0
    keep = finite & ~negative_zero
    if name == "int8":  # MXINT8 is kept symmetric: -2.0 (0x80) is decoded but never produced; it saturates
        keep[0x80] = False
        assert mx.encode_elements(torch.tensor([-2.0]), fmt).item() == 0x81
    assert torch.equal(mx.encode_elements(values[keep], fmt), codes[keep])
    assert (mx.encode_elements(values[negative_zero], fmt) == 0).all()
    if name in ML_DTYPES:  # our code -> value table equals ml_dtypes' own decoding of every bit pattern
        ref = np.arange(1 << fmt.bits, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)
        assert np.array_equal(values.numpy(), ref, equal_nan=True) or name == "fp8_e5m2"
        if name == "fp8_e5m2":  # ml_dtypes decodes 0x7C as Inf; mx.py marks Inf and NaN codes alike as unusable
            assert np.array_equal(values[finite].numpy(), ref[finite.numpy()])


def test_reference_vectors():
    fp4, e3m2 = mx.FORMATS["fp4_e2m1"], mx.FORMATS["fp6_e3m2"]
    x = torch.tensor([0.25, 0.4, 0.6, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.1])
    want = torch.tensor([0, 0.5, 0.5, 1, 1, 2, 2, 4, 4, 6])
    assert torch.equal(mx.decode_elements(mx.encode_elements(x, fp4), fp4), want)
    assert torch.equal(mx.decode_elements(mx.encode_elements(-x, fp4), fp4), -want)
    codes = mx.encode_elements(torch.tensor([29.0, 26.0, 0.1251, 0.0314, 0.03]), e3m2)
    assert codes.tolist() == [0b011111, 0b011110, 0b000010, 0b000001, 0]


def random_blocks(seed, rows=64, blocks=16):
    """Blocks whose magnitudes span 2^-30 .. 2^20, with exact ties and values at the format edges."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, blocks * mx.BLOCK, generator=g)
    w = w * torch.exp2(torch.randint(-30, 20, (rows, blocks), generator=g).float()).repeat_interleave(mx.BLOCK, 1)
    w[0, :8] = torch.tensor([7.5, 7.75, 6.0, 5.0, 2.5, 0.25, 28.0, 30.0])  # saturating and tie values, block 0
    return w


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("name", [*ML_DTYPES, "int8"])
def test_encoding_is_bit_identical_to_ml_dtypes(name, rule):
    fmt = mx.FORMATS[name]
    w = random_blocks(zlib.crc32(f"{name} {rule}".encode()))
    codes, scales = mx.quantize(w, fmt, rule)
    # The reference: scale from its definition, then ml_dtypes' cast of value / scale, clipped to max normal.
    scale = mx.scale_values(scales).repeat_interleave(mx.BLOCK, 1)
    scaled = (w / scale).clamp(-fmt.max_normal, fmt.max_normal).numpy()
    if name == "int8":
        ref = np.round(scaled * 64).astype(np.int8).view(np.uint8)
    else:
        ref = scaled.astype(ML_DTYPES[name]).view(np.uint8)
        ref = np.where(ref == (1 << (fmt.bits - 1)), 0, ref)  # -0 -> +0, as in the table
        codes = torch.where(codes == (1 << (fmt.bits - 1)), 0, codes)
    assert np.array_equal(codes.numpy(), ref)
    # E8M0 scales equal ml_dtypes' own E8M0 encoding of the power of two
    assert np.array_equal(mx.scale_values(scales).numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8),
                          scales.numpy())


@pytest.mark.parametrize("name", ML_DTYPES)
def test_ties_and_binade_edges_round_as_ml_dtypes(name):
    """Every value of the format, every midpoint of two neighbours (a tie: the even code wins), the floats either side
    of it, float32 subnormals and values past the largest normal: encode_elements' codes are ml_dtypes' cast."""
    fmt = mx.FORMATS[name]
    values = fmt.values[~fmt.values.isnan()]
    middles = (values[1:] + values[:-1]) / 2  # exact in float32: the formats have at most 3 mantissa bits
    x = torch.cat([values, middles, torch.nextafter(middles, torch.tensor(0.0)),
                   torch.nextafter(middles, torch.tensor(float("inf"))),
                   torch.tensor([1e-45, 1e-38, fmt.max_normal * 1.01, fmt.max_normal * 4, float("inf")])])
    x = torch.cat([x, -x])
    ref = x.clamp(-fmt.max_normal, fmt.max_normal).numpy().astype(ML_DTYPES[name]).view(np.uint8)
    ref = np.where(ref == (1 << (fmt.bits - 1)), 0, ref)  # -0 -> +0, as encode_elements gives it
    assert np.array_equal(mx.encode_elements(x, fmt).numpy(), ref)


def test_scale_rules():
    fp4 = mx.FORMATS["fp4_e2m1"]
    block = torch.zeros(1, 32)
    block[0, 0] = 7.9
    codes, scales = mx.quantize(block, fp4, "floor")
    assert mx.dequantize(codes, scales, fp4)[0, 0] == 6.0  # floor: scale 1, the maximum saturates
    codes, scales = mx.quantize(block, fp4, "rceil")
    assert mx.dequantize(codes, scales, fp4)[0, 0] == 8.0  # rceil: scale 2, 7.9/2 = 3.95 -> 4
    for name, fmt in mx.FORMATS.items():  # rceil never saturates; its scale is the smallest that avoids it
        w = random_blocks(1).unflatten(-1, (-1, 32))
        codes, scales = mx.quantize(w.flatten(-2), fmt, "rceil")
        scale = mx.scale_values(scales).unsqueeze(-1)
        assert ((w / scale).abs() <= fmt.max_normal).all()
        assert (w.abs().amax(-1) > fmt.max_normal * scale.squeeze(-1) / 2).all()


def test_special_blocks():
    fmt = mx.FORMATS["fp6_e2m3"]
    w = torch.randn(3, 64)
    w[0, 5] = float("nan")
    w[1, 40] = float("inf")
    w[2, :32] = 0
    codes, scales = mx.quantize(w, fmt)
    out = mx.dequantize(codes, scales, fmt)
    assert out[0, :32].isnan().all() and not out[0, 32:].isnan().any()
    assert out[1, 32:].isnan().all() and not out[1, :32].isnan().any()
    assert scales[2, 0] == 0 and (out[2, :32] == 0).all()  # all-zero block: smallest scale, zero elements
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize(torch.randn(2, 48), fmt)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_packing_round_trips_densely(bits):
    codes = torch.randint(0, 1 << bits, (5, 96), dtype=torch.int32).to(torch.uint8)
    packed = mx.pack(codes, bits)
    assert packed.shape == (5, 96 * bits // 8)
    assert torch.equal(mx.unpack(packed, bits), codes)
    if bits == 4:
        assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)  # element 2i in the low nibble


@pytest.mark.parametrize("mode", ["int8", "int4", *__import__("quantize").MX_MODES])
def test_every_mode_quantizes_and_runs_off_the_cpu(mode):
    """On another device the tables must be there too: the meta device checks devices as CUDA does (a CPU table
    indexed by the codes' device raised 'Tensor on device meta is not on the expected device cpu'), and nothing may
    read a value back to the host (a CUDA sync; a FakeTensor cannot). Quantize a weight there, and run the layer."""
    import torch.nn as nn
    import quantize
    linear = nn.Linear(64, 32, bias=False, device="meta")
    module = quantize.quantized_linear(mode, linear, 32)
    tensors = quantize.quantize_tensor(mode, linear.weight, 32, mx.DEFAULT_RULE.get(quantize.MX_MODES.get(mode)))
    assert all(t.device.type == "meta" for t in tensors.values())
    module.load_state_dict(tensors, strict=False, assign=True)
    assert module(torch.empty(2, 64, device="meta")).shape == (2, 32)
    for fmt in mx.FORMATS.values():
        assert fmt.max_normal == fmt.values.nan_to_num(0).max().item()
