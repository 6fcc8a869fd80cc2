"""The CUDA backend's Triton kernels (gpu_kernels.py), run by Triton's interpreter on CPU tensors: each product
against a float64 reference from its format's definition, every row bit for bit the same at 1, 2, ..., 17 rows,
attention likewise, and a tiny model served by gpu.py's modules against model.py in float32. The interpreter checks
indexing, decoding and row invariance, not a GPU's bits: scripts/gpu_check_more.sh runs tests/test_cuda.py on one.

Triton reads TRITON_INTERPRET when it is first imported (and torch imports it on its own), so these run in a process
of their own: tests/test_gpu.py starts it.

    TRITON_INTERPRET=1 python -m pytest -q tests/gpu_kernels_checks.py
"""
import functools
import os

import pytest
import torch
import triton
import triton.language as tl

import backend
import gpu_kernels
import mx
import quantize
from model import ModelArgs, Transformer

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (tests/test_gpu.py does)"
ROWS = backend.LONGEST_VERIFY
K, N = 256, 80  # k in 2 steps of 128; N not a multiple of the 32-column tile: its masked edge is checked too


def dot_a_row_at_a_time(interpreter):
    """The interpreter's tl.dot is numpy's matmul, whose BLAS rounds a tile's row by its position in the tile (its
    micro-kernels cover rows in groups): a row's sums at position 13 of a verify's tile and at position 0 of a decode's
    then differ in the last bit now and then, which a GPU's matrix instructions, alike for every row, do not. Here it
    multiplies a row at a time, each as the first row of a tile, as the hardware does every row."""
    import numpy as np
    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.data.dtype != np.float32:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)
    interpreter.InterpreterBuilder.create_dot = create_dot


@pytest.fixture(scope="module")
def kernels():
    import triton.runtime.interpreter
    dot_a_row_at_a_time(triton.runtime.interpreter)
    import gpu_kernels
    return gpu_kernels


def quantized(mode, w):
    module = quantize.FORMATS[mode].module.empty(mode, w.shape[1], w.shape[0], False, 32)
    module.load_state_dict(quantize.quantize_tensor(mode, w, 32, "rceil"), assign=True)
    return module


def definition(mode, module, x):
    """float64: the inputs rounded as the format rounds them, times the weight its definition gives (each weight
    in the input's dtype, as the reference forward multiplies it), int8's scales after the product."""
    if mode == "bf16":
        return x.double() @ module.double().T
    levels = 127 if mode in ("int4", "int4k") else quantize.WIDE
    if mode.startswith("mx") and not module.fmt.integer_multiple:
        levels = None
    rows = x if levels is None else quantize.round_activations(x, levels)
    if mode == "int8":
        return (rows.double() @ module.weight.double().T) * module.scales.double()
    if mode == "int4":
        scales, zeros = (t.double().T.repeat_interleave(32, 1) for t in module.scales_and_zeros.unbind(-1))
        weight = (mx.unpack(module.weight, 4).double() - 8) * scales + zeros
    elif mode == "int4k":  # each weight rounded once in float32, as its definition rounds it
        weight = module.dequantize().double()
    else:
        weight = mx.dequantize(mx.unpack(module.weight, module.fmt.bits), module.scales, module.fmt).double()
    return rows.double() @ weight.to(x.dtype).double().T


def product_of(kernels, mode, module, x, parts=None):
    from gpu import RowsLinear
    if mode == "bf16":
        return kernels.rows_product(x, module, parts=parts)
    linear = RowsLinear(module)
    if parts is None:  # through gpu.py's module and its custom op
        return linear(x)
    rows = x if linear.levels is None else quantize.round_activations(x, linear.levels)
    return kernels.rows_product(rows, linear.weight, linear.factors, linear.code, linear.bits, linear.group,
                                linear.out_features, mx.FORMATS[linear.element] if linear.element else None, parts)


@pytest.mark.parametrize("mode, parts", [(mode, None) for mode in ["bf16", "int8", "int4", "int4k", "mxfp6", "mxfp4",
                                                                    "mxfp8", "mxfp6_e3m2", "mxint8"]] +
                         [(mode, 2) for mode in ["bf16", "int8", "int4", "int4k", "mxfp6"]])
def test_a_product_is_its_format_s_definition_and_each_row_is_computed_alone(kernels, mode, parts):
    """parts: k in that many slices (split-K: float32 partial sums added in order), as a GPU's kernel splits it."""
    g = torch.Generator().manual_seed(0)
    k = 320 if mode == "int4k" else K  # int4k: a super-block of 256 inputs and a shorter one
    w = torch.randn(N, k, generator=g) * 0.1
    x = torch.randn(ROWS, k, generator=g).bfloat16()
    module = w.bfloat16() if mode == "bf16" else quantized(mode, w)
    product = functools.partial(product_of, parts=parts)
    together = product(kernels, mode, module, x)
    want = definition(mode, module, x)
    # float32 sums of exact products, then one rounding to bf16: within 2 bf16 ulps of the exact result
    assert ((together.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all(), (together.double() - want).abs().max()
    for n in range(1, ROWS + 1):
        assert torch.equal(product(kernels, mode, module, x[:n]), together[:n]), n
    assert torch.equal(product(kernels, mode, module, x[ROWS - 1:]), together[ROWS - 1:])


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_code_words_hold_the_file_s_codes(kernels, bits):
    """layout()'s words, read back as the kernel reads them (code k in bits (k % (32 / bits)) * bits of word
    k // (32 / bits); 6 bits as a 4-bit plane and a 2-bit plane), are the codes mx.unpack finds in the file."""
    n, k = 48, 320
    codes = torch.randint(0, 1 << bits, (n, k), generator=torch.Generator().manual_seed(4)).to(torch.uint8)
    words = kernels.code_words(mx.pack(codes, bits), bits)

    def read(plane, b):  # plane [K * b / 32, N] -> codes [N, K]
        per = 32 // b
        shifts = torch.arange(per, dtype=torch.int32) * b
        return ((plane.T[:, :, None] >> shifts) & ((1 << b) - 1)).reshape(n, -1)
    assert words.dtype == torch.int32 and words.shape == (k * bits // 32, n)
    got = read(words[:k // 8], 4) | read(words[k // 8:], 2) << 4 if bits == 6 else read(words, bits)
    assert torch.equal(got.to(torch.uint8), codes)


@triton.jit
def decode_kernel(code_ptr, scale_ptr, out_ptr, BITS: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                  NAN_FROM: tl.constexpr, CODES: tl.constexpr):
    code = tl.load(code_ptr + tl.arange(0, CODES))
    e8m0 = tl.load(scale_ptr + tl.arange(0, 256))
    value = gpu_kernels.element_value(code[:, None], BITS, EBITS, MBITS, NAN_FROM) * \
        gpu_kernels.scale_value(e8m0[None, :])
    tl.store(out_ptr + tl.arange(0, CODES)[:, None] * 256 + tl.arange(0, 256)[None, :], value)


@pytest.mark.parametrize("name", list(mx.FORMATS))
def test_mx_elements_and_scales_built_from_their_bits_are_mx_py_s_values(kernels, name):
    """Every code of every MX element format times every E8M0 scale, decoded by the product kernel's bit arithmetic
    (no table), is mx.py's value times mx.py's scale: the same float32 bits (NaN codes and the NaN scale NaN)."""
    fmt = mx.FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.int32)
    scales = torch.arange(256, dtype=torch.int32)
    got = torch.empty(1 << fmt.bits, 256)
    decode_kernel[(1,)](codes, scales, got, BITS=fmt.bits, EBITS=fmt.ebits, MBITS=fmt.mbits,
                 NAN_FROM=(1 << fmt.bits - 1) - len(fmt.nan_codes), CODES=1 << fmt.bits)
    want = mx.decode_elements(codes.to(torch.uint8), fmt)[:, None] * mx.scale_values(scales.to(torch.uint8))[None, :]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0).view(torch.int32), want.nan_to_num(0).view(torch.int32))


def test_rms_norm_is_its_reference_and_each_row_is_computed_alone(kernels):
    """gpu_kernels.rows_norm, model.py's rms_norm op on CUDA: within one bf16 rounding of the float64 norm (rounded to
    bf16 before the weight, as the reference), each row of 17 the row alone, bit for bit."""
    import model
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, ROWS, 200, generator=g) * 5).bfloat16()
    weight = (1 + 0.3 * torch.randn(200, generator=g)).bfloat16()
    together = kernels.rows_norm(x, weight, 1e-5)
    want = model.rms_norm(x.double(), weight.double(), 1e-5)
    assert ((together.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()
    for n in (1, 2, 7, ROWS):
        assert torch.equal(kernels.rows_norm(x[:, :n], weight, 1e-5), together[:, :n]), n
    assert torch.equal(kernels.rows_norm(x[:, ROWS - 1:], weight, 1e-5), together[:, ROWS - 1:])


VISIBILITY = {"causal": lambda s, p: s <= p,  # what a row at position p sees of slot s: model.py's, and forks'
              "sinks and a window": lambda s, p: (s <= p) & ((s < 4) | (s > p - 30)),
              "a prefix every row sees": lambda s, p: (s <= p) | (s < 120)}


@pytest.mark.parametrize("parts, visibility", [(3, "causal"), (3, "sinks and a window"),
                                               (None, "a prefix every row sees")])  # (~20 s each, interpreted)
def test_attention_is_softmax_over_the_slots_a_row_sees_and_each_row_is_computed_alone(kernels, parts, visibility):
    """parts: the cache in that many parts (as a long cache is split), combined in order; a row whose position ends
    before a part leaves it empty, and so does a block of slots it does not see (a window's, sinks' gap)."""
    g = torch.Generator().manual_seed(1)
    batch, kv, groups, hd, slots = 2, 2, 3, 32, 150  # 150 slots: three key blocks, the last one partial
    q = torch.randn(batch, kv, groups * ROWS, hd, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv, slots, hd, generator=g).bfloat16() for _ in range(2))
    start = torch.tensor([[100], [5]])
    positions = start + torch.arange(ROWS)
    visible = VISIBILITY[visibility](torch.arange(slots), positions[..., None])

    def attend(first, n):  # query tokens first .. first + n - 1 of each group
        rows = q.view(batch, kv, groups, ROWS, hd)[:, :, :, first:first + n].reshape(batch, kv, groups * n, hd)
        out = kernels.rows_attention(rows, k, v, visible[:, first:first + n], parts=parts)
        return out.view(batch, kv, groups, n, hd)
    together = attend(0, ROWS)
    seen = visible[:, None]  # [B, 1, T, S]
    scores = (q.double().view(batch, kv, groups, ROWS, hd) @ k.double()[:, :, None].transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(~seen[:, :, None], float("-inf"))
    want = scores.softmax(-1) @ v.double()[:, :, None]
    assert ((together.double() - want).abs() <= 2 ** -7 * want.abs() + 2 ** -9).all()
    for n in (1, 2, 7, ROWS):
        assert torch.equal(attend(0, n), together[:, :, :, :n]), n
    assert torch.equal(attend(ROWS - 1, 1), together[:, :, :, ROWS - 1:])


@pytest.mark.parametrize("mode", [None, "int4"])
def test_a_tiny_model_served_by_the_kernels_is_model_py_and_verifies_exactly(kernels, mode):
    """float32: the served model's logits within 1e-5 of model.py's (int4: 5e-3, where an input a rounding of its
    8-bit activations apart moves them); in bf16, as steps run, gpu.exact_verify_tokens finds every row of a 6-row
    step equal to the row alone, bit for bit, through every product and attention (model.py's rms_norm and attention
    ops on the Triton kernels, registered for CPU tensors here; the tests above hold each kernel so at 1 to 17 rows,
    and the interpreter takes ~0.1 s a kernel call)."""
    import gpu
    args = ModelArgs(vocab_size=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=192,
                     max_seq_len=64)
    torch.manual_seed(0)
    reference = Transformer(args)
    if mode:
        quantize.quantize_model(reference, mode)
    reference.setup_caches(1, 64)
    served = Transformer(args) if not mode else quantize.quantize_model(Transformer(args), mode)
    served.load_state_dict(reference.state_dict())
    served.setup_caches(1, 64)
    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    for op in list(gpu.served_ops):  # model.py's ops as they are, for the reference (an earlier test served them)
        gpu.serve(op, False)
    with torch.no_grad():
        reference(tokens[:, :5], torch.arange(5)[None])
        want = reference(tokens[:, 5:], torch.arange(5, 9)[None])
    products, refused = gpu.serve_rows(served, "CPU")  # the interpreter runs the kernels on CPU tensors
    assert refused == [] and products == 2 * 4 + 1 and set(gpu.served_ops) == {"attention", "rms_norm"}
    with torch.no_grad():
        served(tokens[:, :5], torch.arange(5)[None])  # a prompt: model.py's SDPA
        got = served(tokens[:, 5:], torch.arange(5, 9)[None])
    assert (got - want).abs().max() <= (5e-3 if mode else 1e-5) * want.abs().max()
    bf16 = Transformer(args) if not mode else quantize.quantize_model(Transformer(args), mode)
    bf16.load_state_dict(reference.state_dict())
    bf16 = bf16.bfloat16()
    bf16.setup_caches(1, 64)
    gpu.serve_rows(bf16, "CPU")
    assert gpu.exact_verify_tokens(bf16, most=6) == (6, "")


def test_compiled_with_the_kernels_a_verify_s_rows_are_decode_steps_bit_for_bit(kernels):
    """torch.compile(fullgraph=True) traces the kernels as custom ops (their fake implementations) and calls them:
    an int4 bf16 model's 8-row verify gives the logits of 8 one-row decode steps, bit for bit (Inductor's CPU code
    around the ops here; CUDA graphs on a GPU: tests/test_cuda.py)."""
    import gpu
    args = ModelArgs(vocab_size=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=192,
                     max_seq_len=64)
    torch.manual_seed(0)
    served = quantize.quantize_model(Transformer(args), "int4").bfloat16()
    served.setup_caches(1, 64)
    assert gpu.serve_rows(served, "CPU") == (9, [])
    step = torch.compile(served, fullgraph=True, dynamic=False)
    tokens = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        served(tokens[:, :5], torch.arange(5)[None])
        verify = step(tokens[:, 5:], torch.arange(5, 13)[None])
        decodes = torch.cat([step(tokens[:, i:i + 1], torch.tensor([[i]])) for i in range(5, 13)], 1)
    assert torch.equal(verify, decodes)
