"""The CPU backend (cpu/): few_rows.cpp's kernels against float64 and against themselves (rows, builds, threads),
the one-call step against model.py's forward, where the backend serves and where it refuses."""
import hashlib
import inspect
import json
import linecache
import os
import platform
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import backend
import cpu
import model
import quantize
from conftest import ROOT, read_line
from cpu import fingerprints, kernels, modules, one_call
from cpu.kernels import product
from cpu.modules import code_table
from decoding import Step, Steps, decode_one_token, generate
from loading import load_model
from tokenizer import Tokenizer


def served_model(dtype, family="llama", **overrides):
    """A random model (weights ~ N(0, 0.2)) that the CPU backend serves."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)
    m = model.Transformer(model.ModelArgs(**{**sizes, **overrides}, family=family))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    m = m.to(dtype).eval()
    assert (cpu.apply(m).name == "cpu") == (dtype != torch.float16)
    return m


@torch.no_grad()
def one_call_and_forward(m, tokens, positions):
    """(logits, k and v caches after) of one step run as one few_rows.cpp call, then of the same step from the same
    cache through model.py's forward (around the backend's products and attention)."""
    assert isinstance(m.one_call_step, one_call.OneCallStep)
    caches = [layer.attention.kv_cache for layer in m.layers]
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
    results = []
    for run in (m, lambda *a: model.Transformer.forward(m, *a)):
        for c, (k, v) in zip(caches, before):
            c.k_cache.copy_(k)
            c.v_cache.copy_(v)
        logits = run(tokens, positions)
        results.append((logits, [c.k_cache.clone() for c in caches], [c.v_cache.clone() for c in caches]))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_in_one_call_computes_what_forward_computes(dtype):
    """few_rows.cpp's llama_step against model.py's forward around the same products from the same cache, with
    q/k/v biases (Qwen2), grouped KV heads and rotary on part of each head: a decode (2 rows), a verify (2 x 5) and
    2 x 8 rows at positions far apart. bf16: it rounds where eager PyTorch rounds and sums RMSNorm's squares in
    PyTorch's order, so the logits and the cache entries it writes are the same bits; float32: within 1e-5
    (PyTorch sums several rows' squares in another order than one row's)."""
    m = served_model(dtype, qkv_bias=True, rotary_dim=8)
    m.setup_caches(2, 64)
    torch.manual_seed(1)
    with torch.no_grad():
        m(torch.randint(0, 256, (2, 20)), torch.arange(20).expand(2, 20), torch.tensor([[19], [12]]))
    tolerance = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for tokens, positions in [(torch.tensor([[7], [9]]), torch.tensor([[20], [13]])),
                              (torch.randint(0, 256, (2, 5)), torch.tensor([[21], [14]]) + torch.arange(5)),
                              (torch.randint(0, 256, (2, 8)), torch.tensor([[30], [3]]) + torch.arange(8))]:
        one_call, forward = one_call_and_forward(m, tokens, positions)
        torch.testing.assert_close(one_call, forward, **tolerance)


def test_smollm2_bf16_steps_in_one_call_are_model_py_bit_for_bit(smollm2):
    """Real weights, bf16: 24 decode steps of random tokens and a 5-row verify from the same cache states, one call
    against model.py's forward around the same products: the same logits, bit for bit. (With RMSNorm's squares
    summed in sequence instead of in PyTorch's order, 18 of 40 such steps were.)"""
    ckpt, _ = smollm2
    m = load_model(ckpt, "cpu", torch.bfloat16)
    m.setup_caches(1, 256)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m(torch.randint(0, 49152, (1, 80), generator=generator), torch.arange(80)[None], torch.tensor([[79]]))
    for i in range(25):
        rows = 5 if i == 24 else 1
        tokens = torch.randint(0, 49152, (1, rows), generator=generator)
        (one_call, *_), (forward, *_) = one_call_and_forward(m, tokens, torch.arange(80 + i, 80 + i + rows)[None])
        assert torch.equal(one_call, forward), (i, (one_call.float() - forward.float()).abs().max())


def test_an_8_row_verify_is_8_decode_steps_bit_for_bit(smollm2):
    """Real weights, bf16, with the backend: the logits of a verify of 8 tokens (K = 7) equal, bit for bit, those of
    8 one-token decode steps of the same tokens from the same cache state (what makes K = 7 exact)."""
    ckpt, _ = smollm2
    verify, steps, _ = verify_and_steps(load_model(ckpt, "cpu", torch.bfloat16))
    assert torch.equal(verify, steps), (verify.float() - steps.float()).abs().max()


def verify_and_steps(m):
    """After a 60-token prompt: the logits of a verify of 8 random tokens, those of 8 one-token steps of the same
    tokens from the same cache state, and the tokens."""
    m.setup_caches(1, 256)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m(torch.randint(0, 49152, (1, 60), generator=generator), torch.arange(60)[None])
        tokens = torch.randint(0, 49152, (1, 8), generator=generator)
        verify = m(tokens, torch.arange(60, 68)[None])
        steps = torch.cat([m(tokens[:, i:i + 1], torch.tensor([[60 + i]])) for i in range(8)], 1)
    return verify, steps, tokens


def test_a_fork_s_edited_activation_keeps_the_one_call_step_calling_its_mlp(smollm2, monkeypatch, capsys):
    """SmolLM2 in bf16 with model.FeedForward.forward edited (SiLU -> GELU): the backend still serves every product
    and each step is still one few_rows.cpp call, which calls the fork's MLP (model.py's code, its products
    few_rows.cpp's) for each layer; the step is model.py's forward around the kernels bit for bit (the canary checked
    it); an 8-token verify's logits are 8 decode steps' bit for bit (speculation stays exact); the w2(h) its forward
    returns as it is is computed by the step, and a forward that reads it, keeps it or gets it from a helper, or a
    hook on w2, gets w2's own product, bit for bit as model.py's forward; an error in the MLP's code reaches the
    caller as itself, an output of another shape one line naming both. Its speed: scripts/bench_fork.py."""
    source = inspect.getsource(model.FeedForward.forward)
    monkeypatch.setattr(model.FeedForward, "forward", defined(source.replace(
        "F.silu(self.w1(x))", 'F.gelu(self.w1(x), approximate="tanh")')))
    ckpt, _ = smollm2
    capsys.readouterr()
    m = load_model(ckpt, "cpu", torch.bfloat16)
    assert "each step one few_rows.cpp call that runs model.py's code for the MLP" in warnings_in(
        capsys.readouterr().err)
    layer = m.layers[0]
    assert [type(x) for x in (layer, layer.attention, layer.feed_forward)] == [
        model.Block, modules.Attention, model.FeedForward]
    assert isinstance(layer.feed_forward.w1, modules.Linear) and isinstance(layer.feed_forward.w3, one_call.LookedUp)
    report = backend.report(m)
    assert report.name == "cpu" and report.one_call_step and not report.sizes_threads
    assert "calling its MLP as model.py's code" in report.serves
    verify, steps, tokens = verify_and_steps(m)
    assert torch.equal(verify, steps), (verify.float() - steps.float()).abs().max()
    with torch.no_grad():  # model.py's forward around the same modules, the last step again
        around = model.Transformer.forward(m, tokens[:, -1:], torch.tensor([[67]]))
    assert torch.equal(around, steps[:, -1:])
    products = []  # in a step, the fork's w1(x) and w3(x) are the step's stacked product's halves, and the step
    # computes the w2(h) its forward returns as it is: no product runs in Python
    monkeypatch.setattr(modules.Linear, "forward", lambda self, x: products.append(self) or torch.zeros(
        *x.shape[:-1], self.weight.shape[0], dtype=x.dtype))
    with torch.no_grad():
        m(tokens[:, :1], torch.tensor([[60]]))
    assert products == []
    monkeypatch.undo()

    def gelu_mlp(self, x):
        return torch.nn.functional.gelu(self.w1(x), approximate="tanh") * self.w3(x)

    def scaled(self, x):  # reads w2's output: its own product
        return self.w2(gelu_mlp(self, x)) * 0.5

    def kept(self, x):  # keeps it before returning it: its own product
        y = self.w2(gelu_mlp(self, x))
        return y

    def down(self, x):  # a helper returns it, but to the forward, which reads it: its own product
        return self.w2(gelu_mlp(self, x))

    def through_a_helper(self, x):
        return down(self, x) + 0
    seen = []
    hook = m.layers[3].feed_forward.w2.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    for forward in (model.FeedForward.forward, scaled, kept, through_a_helper):
        monkeypatch.setattr(model.FeedForward, "forward", forward)
        with torch.no_grad():
            step = m(tokens[:, :1], torch.tensor([[60]]))
            around = model.Transformer.forward(m, tokens[:, :1], torch.tensor([[60]]))
        assert torch.equal(step, around), forward.__name__
    hook.remove()
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen[::2], seen[1::2]))  # a hook sees products

    def mutating(self, x):  # changes w1's output in place, then asks for it again: it gets its own product
        self.w1(x).mul_(2)
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
    monkeypatch.setattr(model.FeedForward, "forward", mutating)
    with torch.no_grad():
        step = m(tokens[:, :1], torch.tensor([[60]]))
        around = model.Transformer.forward(m, tokens[:, :1], torch.tensor([[60]]))
    assert torch.equal(step, around)

    def broken(self, x):
        raise ValueError("a fork's bug")
    monkeypatch.setattr(model.FeedForward, "forward", broken)
    with pytest.raises(ValueError, match="a fork's bug"), torch.no_grad():
        m(tokens[:, :1], torch.tensor([[60]]))

    def cut(self, x):  # an output the residual cannot take: one line naming the function and both shapes
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))[..., :10]
    monkeypatch.setattr(model.FeedForward, "forward", cut)
    with pytest.raises(ValueError, match=r"model.FeedForward.forward returned \[1, 1, 10\] torch.bfloat16 for rows "
                                         r"\[1, 1, 576\] torch.bfloat16"), torch.no_grad():
        m(tokens[:, :1], torch.tensor([[60]]))


def test_stream_read_reads_every_word():
    """The bench's read probe touches the whole buffer: its result is the xor of every 32-bit word, so a skipped
    page or task changes it."""
    import numpy as np
    assert kernels.load()
    words = torch.randint(-2**31, 2**31 - 1, (3 * 4096 * 17 // 4,), dtype=torch.int32)
    assert torch.ops.few_rows.stream_read(words) == int(np.bitwise_xor.reduce(words.numpy()))
    with pytest.raises(RuntimeError, match="whole 4 KiB pages"):
        torch.ops.few_rows.stream_read(torch.zeros(100, dtype=torch.uint8))


def test_a_step_runs_in_one_call_only_where_it_can():
    """Llama-family steps on CPU in bf16 or float32 run as one call, and a compiled step then compiles nothing,
    whatever the number of rows (a verify of K = 32 and batch rows included); a position past the cache is refused,
    not written; prompts (logits of chosen positions) and more than 33 tokens a row take model.py's forward; a
    CodeGen model gets the backend's products and attention but no one-call step, an fp16 model nothing."""
    from torch._dynamo.utils import counters
    m = served_model(torch.bfloat16)
    m.setup_caches(40, 64)
    assert backend.report(m).one_call_step and isinstance(m.one_call_step, one_call.OneCallStep)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    step = Step(decode_one_token, compile=True)
    with torch.no_grad():
        step(m, torch.arange(40) % 7, torch.zeros(40, dtype=torch.long), 0.0, None, None)
        assert counters["stats"]["unique_graphs"] == graphs
        # torch.compile of forward itself traces the call as one op (its fake implementation gives the shape)
        tokens, positions = torch.arange(40)[:, None], torch.ones(40, 1, dtype=torch.long)
        compiled = torch.compile(m.forward, fullgraph=True)(tokens, positions)
        assert torch.equal(compiled, m(tokens, positions))
        with pytest.raises(RuntimeError, match="position 64 is outside the cache of 64"):
            m(tokens, positions * 64)
        long = torch.arange(34).expand(40, 34) % 7, torch.arange(34).expand(40, 34)  # not a step: model.py's forward
        assert torch.equal(m(*long), model.Transformer.forward(m, *long))
    codegen = served_model(torch.bfloat16, family="codegen")
    assert not backend.report(codegen).one_call_step and type(codegen.layers[0].attention) is modules.Attention
    fp16 = served_model(torch.float16)
    assert not any(type(x).__module__ == modules.__name__ for x in fp16.modules())


def few_rows_cases():
    """Each weight layout few_rows.cpp reads: (product of x [M, 1536] (some cases: its first 1504 or 1520
    columns), the float weight it stands for, the inputs it multiplies: x itself, x rounded to bf16 for bf16
    weights without block factors when in_features is a multiple of 32 and for packed MX 6-bit codes, for int4
    x rounded to 8 bits per block of 32, for int8 and MX E2M3 tiles to 16 bits)."""
    torch.manual_seed(0)
    n, k = 203, 1536  # n not a multiple of the 16 weight rows product() hands each tile call
    n_tiles = 208
    w = torch.randn(n, k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    per_channel, per_block = torch.rand(n) + 0.5, torch.rand(n, k // 32) + 0.5
    import quantize
    from cpu.modules import block_tiles, fp6_tiles, int4_tiles, integer_table, padded, pair_tiles
    int4 = torch.randint(0, 16, (n_tiles, k), dtype=torch.uint8)  # int4 tiles hold 16 output columns each
    scales_and_zeros = torch.stack([torch.rand(k // 64, n_tiles) + 0.5, torch.randn(k // 64, n_tiles)], -1).bfloat16()
    tiles, tile_factors = int4_tiles(int4, scales_and_zeros)
    scale, zero = (t.float().T.repeat_interleave(64, 1) for t in scales_and_zeros.unbind(-1))
    # groups of 32 and an odd number of 32-element blocks
    int4_odd = int4[:, :-32].contiguous()
    odd_factors = torch.stack([torch.rand(k // 32 - 1, n_tiles) + 0.5, torch.randn(k // 32 - 1, n_tiles)], -1).bfloat16()
    odd_tiles, odd_tile_factors = int4_tiles(int4_odd, odd_factors)
    odd_scale, odd_zero = (t.float().T.repeat_interleave(32, 1) for t in odd_factors.unbind(-1))
    import mx
    fp6 = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    e8m0 = torch.randint(120, 135, (n, k // 32), dtype=torch.uint8)
    packed = {f: (mx.pack(fp6, 6), code_table(mx.FORMATS[f]), mx.dequantize(fp6, e8m0, mx.FORMATS[f]))
              for f in ("fp6_e2m3", "fp6_e3m2")}
    e2m3 = mx.FORMATS["fp6_e2m3"]
    x = torch.randn(33, k)  # up to a verify of K = 32
    x[3, 32:64] = 0  # an all-zero block
    same = lambda x: x  # noqa: E731
    wide = lambda x: quantize.round_activations(x, quantize.WIDE)  # noqa: E731
    return x, {
        # MX 6-bit codes as packed in the file, one E8M0 scale per 32; inputs rounded to bf16, as for bf16 pairs
        **{f"{f} packed": (lambda x, c=c, t=t: product(x, c, e8m0, t), w,
                           lambda x: x.bfloat16().float()) for f, (c, t, w) in packed.items()},
        # in_features an odd number of 32-element blocks: the last one alone
        "fp6_e2m3 packed, K % 64 = 32": (
            lambda x: product(x[:, :-32].contiguous(), mx.pack(fp6[:, :-32], 6), e8m0[:, :-1].contiguous(),
                                      packed["fp6_e2m3"][1]),
            packed["fp6_e2m3"][2][:, :-32], lambda x: x[:, :-32].bfloat16().float()),
        "fp32": (lambda x: product(x, w), w, same),
        # bf16 weights in column tiles multiply the inputs rounded to bf16 (a bf16 model's are already), in pairs
        # (vdpbf16ps); 203 outputs: the last tile padded
        "bf16 tiles": (lambda x: product(x, pair_tiles(w.bfloat16()))[:, :n], w.bfloat16().float(),
                       lambda x: x.bfloat16().float()),
        "bf16 tiles, K % 64 = 32": (lambda x: product(x[:, :-32].contiguous(), pair_tiles(w[:, :-32].bfloat16()))[:, :n],
                                    w[:, :-32].bfloat16().float(), lambda x: x[:, :-32].bfloat16().float()),
        # in_features not a multiple of 32: by rows, each bf16 weight to float times x itself
        "bf16, K % 32 = 16": (lambda x: product(x[:, :-16].contiguous(), w[:, :-16].bfloat16()),
                              w[:, :-16].bfloat16().float(), lambda x: x[:, :-16]),
        "bf16 x block": (lambda x: product(x, w.bfloat16(), per_block),
                         w.bfloat16().float() * per_block.repeat_interleave(32, 1), same),
        # int8 codes in column tiles (203 outputs: the last tile padded), inputs rounded to 16 bits per block
        "int8 x channel": (lambda x: product(x, pair_tiles(codes), padded(per_channel, 208).view(-1, 16))[:, :n],
                           codes * per_channel[:, None], wide),
        "int8 x block": (lambda x: product(x, pair_tiles(codes), block_tiles(per_block))[:, :n],
                         codes * per_block.repeat_interleave(32, 1), wide),
        "int8 x channel, bf16 inputs": (lambda x: product(x.bfloat16(), pair_tiles(codes), padded(per_channel, 208).view(-1, 16))[:, :n],
                                        codes * per_channel[:, None], lambda x: wide(x.bfloat16().float())),
        "int8 x channel, K % 64 = 32": (
            lambda x: product(x[:, :-32].contiguous(), pair_tiles(codes[:, :-32]), padded(per_channel, 208).view(-1, 16))[:, :n],
            codes[:, :-32] * per_channel[:, None], lambda x: wide(x[:, :-32])),
        # MX E2M3 codes in 6-bit column tiles with their E8M0 scales (and the same values as int8 tiles: the same bits)
        "fp6_e2m3 tiles": (lambda x: product(x, fp6_tiles(fp6), block_tiles(e8m0), integer_table(e2m3))[:, :n],
                           packed["fp6_e2m3"][2], wide),
        "fp6_e2m3 as int8 tiles": (
            lambda x: product(x, pair_tiles((mx.decode_elements(fp6, e2m3) * 8).to(torch.int8)),
                              block_tiles(mx.scale_values(e8m0) / 8))[:, :n], packed["fp6_e2m3"][2], wide),
        "int4 x group": (lambda x: product(x, tiles, tile_factors), (int4 - 8.0) * scale + zero,
                         quantize.round_activations),
        "int4 x group of 32, K % 64 = 32": (
            lambda x: product(x[:, :-32].contiguous(), odd_tiles, odd_tile_factors),
            (int4_odd - 8.0) * odd_scale + odd_zero, lambda x: quantize.round_activations(x[:, :-32])),
    }


ATTENTION_GROUPS = (1, 3, 5)  # query heads per KV head: the kernel takes a token's heads 3 at a time (AVX-512)


def attention_inputs(dtype, groups=3):
    """q [B, H_kv, G * T, D] (G query heads per KV head, T = 5 tokens), a 63-slot cache, positions [B, T] up to
    its last slot (whose keys the kernel reads 4 slots at a time: 60..62 are the ragged end)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 64).to(dtype) for n in (groups * 5, 63, 63))
    return q, k, v, torch.tensor([[10, 11, 12, 13, 14], [58, 59, 60, 61, 62]])


def few_rows_outputs():
    x, cases = few_rows_cases()
    outputs = {(name, rows): compute(x[:rows].contiguous()) for name, (compute, _, _) in cases.items()
               for rows in (1, 5, 16)}
    for dtype in (torch.float32, torch.bfloat16):
        for groups in ATTENTION_GROUPS:
            outputs["attention", str(dtype), groups] = torch.ops.few_rows.attention(*attention_inputs(dtype, groups))
    return outputs


def test_few_rows_kernels_match_float64_and_give_every_row_the_same_arithmetic():
    """few_rows.cpp for each weight layout: within 1e-5 relative of a float64 product of the dequantized weight
    and the inputs it multiplies (float32 accumulation over K = 1536; int4: quantize.round_activations, so the
    rounding of the activations is checked too: one q off by one moves the result by ~4e-4 of its largest
    output), and a row's result is bit-identical whether it is computed alone or among 2-8, 16, 17 or 33 rows
    (every pass the kernels make, cpu/few_rows/tiles.h: what keeps speculative verify equal to decode at any K)."""
    assert kernels.load(), "few_rows.cpp did not build (needs a C++ compiler, as torch.compile does)"
    x, cases = few_rows_cases()
    for name, (compute, reference, inputs) in cases.items():
        expected = inputs(x).double() @ reference.double().T
        y = compute(x)
        scale = expected.abs().max()
        assert (y.double() - expected).abs().max() / scale < 1e-5, name
        for rows in (*range(1, 9), 16, 17):
            assert torch.equal(compute(x[-rows:].contiguous()), y[-rows:]), (name, rows)


def test_the_int4_layout_round_trips_between_python_and_the_kernels():
    """The int4 column tiles are written once, by cpu.modules.int4_tiles; few_rows.cpp's reader (Int4Tiles::code, what
    the scalar reference multiplies) gives back every code in place, for even and odd numbers of 32-code blocks."""
    assert kernels.load()
    from cpu.modules import int4_tiles
    torch.manual_seed(0)
    for k in (32, 96, 1536, 1504):
        codes = torch.randint(0, 16, (48, k), dtype=torch.uint8)
        tiles, _ = int4_tiles(codes, torch.zeros(k // 32, 48, 2, dtype=torch.bfloat16))
        assert torch.equal(torch.ops.few_rows.int4_codes(tiles), codes), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_step_s_rms_norm_is_model_py_s_bit_for_bit(dtype):
    """The one-call step's RMSNorm sums the squares in the order of PyTorch's own CPU sum (8-lane vectors, 4 sums, the
    cascade over chunks of 16 groups and more): its outputs are model.RMSNorm's bit for bit, at widths below and above
    the cascade's and with leftover vectors and elements (without the cascade a third of the Qwen 1.5B's rows got
    another mean)."""
    assert kernels.load()
    torch.manual_seed(0)
    for dim in (64, 200, 576, 896, 1000, 1536, 4096, 8960):
        norm = model.RMSNorm(dim, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(1, 0.3)
            x = (torch.randn(300, dim) * torch.rand(300, 1) * 20).to(dtype)
            x[0, :5] = 3e3  # a few massive activations, as Qwen's
            expected = norm(x)
        assert torch.equal(torch.ops.few_rows.rms_norm(x, norm.weight.detach(), 1e-6), expected), dim


def test_few_rows_packed_fp6_nan_scale_makes_its_outputs_nan():
    """An E8M0 scale of 0xFF (NaN) in one block of a weight row makes that row's outputs NaN, and no other."""
    import mx
    assert kernels.load()
    torch.manual_seed(0)
    codes = torch.randint(0, 64, (3, 96), dtype=torch.uint8)
    scales = torch.full((3, 3), 127, dtype=torch.uint8)
    scales[1, 2] = mx.SCALE_NAN
    fmt = mx.FORMATS["fp6_e2m3"]
    y = product(torch.randn(2, 96), mx.pack(codes, 6), scales, code_table(fmt))
    assert y[:, 1].isnan().all() and not y[:, [0, 2]].isnan().any()
    with pytest.raises(RuntimeError, match=r"x must be float32 or bf16 \[M, 96\]"):  # fp16 inputs: refused, named
        torch.ops.few_rows.product(torch.randn(2, 96).half(), torch.randint(-9, 9, (3, 96), dtype=torch.int8),
                                   torch.rand(3), None)


@pytest.mark.parametrize("groups", ATTENTION_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_attention_matches_float64_and_attends_each_row_alone(dtype, groups):
    """few_rows.cpp's attention over the cache: within float32 rounding (plus, in bf16, the output's rounding,
    at most 2^-8 relative) of float64 attention with the mask slot <= position, and each token's rows are
    bit-identical when that token is attended alone (a verify attends as a decode step would)."""
    import torch.nn.functional as F
    assert kernels.load()
    q, k, v, positions = attention_inputs(dtype, groups)
    y = torch.ops.few_rows.attention(q, k, v, positions)
    mask = (torch.arange(63) <= positions[:, None, :, None]).repeat(1, 1, groups, 1)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    bound = expected.abs() * (2**-8 if dtype == torch.bfloat16 else 0) + 1e-5
    assert ((y.double() - expected).abs() <= bound).all()
    by_token = y.view(2, 3, groups, 5, 64)
    for t in range(5):
        alone = torch.ops.few_rows.attention(q.view(2, 3, groups, 5, 64)[:, :, :, t].contiguous(), k, v,
                                             positions[:, t:t + 1].contiguous())
        assert torch.equal(alone, by_token[:, :, :, t]), t


def test_few_rows_ops_declare_no_default_arguments():
    """Inductor's C++ wrapper leaves out trailing arguments equal to their defaults, and the dispatcher call it
    generates then reads past the arguments it was given (torch 2.13: a segfault in the first compiled step). So
    every few_rows op spells out all its arguments."""
    assert kernels.load()
    for name in ("product", "attention", "llama_step"):
        schema = getattr(torch.ops.few_rows, name).default._schema
        assert schema.arguments and not any(a.has_default_value() for a in schema.arguments), str(schema)


AVX2_BUILD = """
import sys, torch
root, out = sys.argv[1:]
sys.path[:0] = [root, root + "/tests"]
from cpu import kernels
kernels.build("haswell")
from test_cpu import few_rows_outputs
torch.save(few_rows_outputs(), out)
"""


PORTABLE_BUILD = """
import sys, torch
root, out = sys.argv[1:]
sys.path[:0] = [root, root + "/tests"]
from cpu import kernels
kernels.build("native", portable=True)
from test_cpu import few_rows_outputs, step_outputs
torch.save({**few_rows_outputs(), **step_outputs()}, out)
"""


GENERIC_BUILD = """
import sys, torch
root, out = sys.argv[1:]
sys.path[:0] = [root, root + "/tests"]
from cpu import kernels
kernels.build("x86-64")
if out != "-":
    from test_cpu import few_rows_outputs
    torch.save(few_rows_outputs(), out)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64")
def test_a_killed_build_blocks_nothing_and_a_waiting_one_says_for_whom(tmp_path):
    """A build killed midway (SIGKILL, as a test's timeout or a closed terminal does) leaves no lock behind: the
    next run builds at once. A run that finds another process building says whose build it waits for. The build
    is the generic x86-64 one (no AVX2): its products and attention match the native build's within bf16 rounding."""
    import fcntl
    root, env = tmp_path / "extensions", dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    killed = subprocess.Popen([sys.executable, "-c", GENERIC_BUILD, str(ROOT), "-"], env=env,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(root.glob("*.build-*/*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the compiler is running
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert list(root.glob("*.build-*")) and not list(root.glob("*.so")), "killed before the build started or after"
    lock = next(root.glob("*.lock"))
    with open(lock, "a+") as held:  # another process's build in progress: wait, saying for whom
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate(0)
        held.write("process 4242")
        held.flush()
        out = tmp_path / "generic.pt"
        second = subprocess.Popen([sys.executable, "-c", GENERIC_BUILD, str(ROOT), str(out)], env=env,
                                  stderr=subprocess.PIPE, text=True)
        waiting = read_line(second.stderr, timeout=300)  # however long a busy machine takes to import torch
        fcntl.flock(held, fcntl.LOCK_UN)
    _, rest = second.communicate(timeout=600)
    stderr = waiting + rest
    assert second.returncode == 0, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(f"waiting for process 4242's build of few_rows.cpp (lock {lock}"), stderr
    assert lines[1].startswith("building few_rows.cpp for this CPU (-march=x86-64;") and " done in " in lines[1]
    assert not list(root.glob("*.build-*")), "the killed build's directory was not cleaned up"
    assert kernels.load()
    generic, native = torch.load(out), few_rows_outputs()
    for case, y in native.items():
        torch.testing.assert_close(generic[case], y, rtol=1e-2, atol=1e-2, msg=case)


def test_kernel_builds_are_keyed_by_their_source():
    """A build is named by a hash of what made it (source, flags, torch, this CPU's features): two checkouts or
    versions never load or rebuild each other's."""
    source = kernels.source_text()
    name = kernels.build_name(source, "native")
    assert name.startswith("few_rows_") and name == kernels.build_name(source, "native")
    assert name != kernels.build_name(source + "\n// an edit", "native")
    assert name != kernels.build_name(source, "haswell")


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs an x86 CPU with AVX2")
def test_few_rows_avx2_build_gives_the_native_build_bits(tmp_path):
    """few_rows.cpp built for AVX2 (16-lane sums in two 256-bit vectors, its own tile shapes) gives the same bits
    as the build for this CPU (products and attention), so on an AVX-512 machine its AVX2 code is exercised too
    (integer tiles: vpmaddubsw and vpmaddwd where this CPU has vpdpbusd and vpdpwssd). Built in an empty cache, it says so in one line with the time it took; loaded again, it says nothing."""
    assert kernels.load()
    out = tmp_path / "avx2.pt"
    root = str(ROOT)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    first = subprocess.run([sys.executable, "-c", AVX2_BUILD, root, str(out)], capture_output=True, text=True,
                           env=env, check=True, timeout=600)
    assert re.fullmatch(r"building few_rows.cpp for this CPU \(-march=haswell; once per source, flags, torch and "
                        r"CPU\)\.\.\. done in \d+ s: .*\.so\n", first.stderr), first.stderr
    again = subprocess.run([sys.executable, "-c", AVX2_BUILD, root, str(out)], capture_output=True, text=True,
                           env=env, check=True, timeout=600)
    assert again.stderr == ""
    avx2, native = torch.load(out), few_rows_outputs()
    for case, y in native.items():
        assert torch.equal(avx2[case], y), case


def step_outputs():
    """llama_step's logits on a small random model, bf16 and float32, 1 and 5 tokens a row (the step's own code:
    norms, rotary, SiLU and roundings around the products and attention)."""
    outputs = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = served_model(dtype)
        m.setup_caches(2, 32)
        with torch.no_grad():
            for tokens in (1, 5):
                ids = torch.arange(2 * tokens).view(2, tokens) % 256
                positions = torch.tensor([[3], [9]]) + torch.arange(tokens)
                outputs["step", str(dtype), tokens] = m(ids, positions).clone()
    return outputs


def test_the_portable_build_gives_the_native_build_bits(tmp_path):
    """few_rows.cpp built for this CPU without intrinsics (-DFEW_ROWS_PORTABLE: its plain code, the same lanes, sums
    and trees) gives the products, attention and one-call steps of the build for this CPU bit for bit: every routine
    written with intrinsics against the scalar reference beside it (few_rows/*.h, named <routine>_reference)."""
    assert kernels.load()
    out = tmp_path / "portable.pt"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    subprocess.run([sys.executable, "-c", PORTABLE_BUILD, str(ROOT), str(out)], capture_output=True, text=True,
                   env=env, check=True, timeout=600)
    portable, native = torch.load(out), {**few_rows_outputs(), **step_outputs()}
    different = [case for case, y in native.items() if not torch.equal(portable[case], y)]
    assert not different, different


def test_many_row_bf16_products_are_float32_products_where_the_cpu_lacks_bf16():
    """A prompt's products (more than 33 tokens a row) in bf16: in column tiles (in_features a multiple of 32), each
    row exactly as a decode computes it alone; by rows (in_features 560) PyTorch's GEMM, where the CPU lacks native
    bf16 in float32 rounded once to bf16 (its bf16 GEMM runs ~6x slower there: a SmolLM2 prefill took 1.4 s)."""
    import torch.nn.functional as F
    assert kernels.load()
    torch.manual_seed(0)
    tiled = modules.Linear(576, 256, bias=True).bfloat16()
    tiled.prepare()
    x = torch.randn(40, 576).bfloat16()
    with torch.no_grad():
        prompt = tiled(x)
        assert all(torch.equal(prompt[i:i + 1], tiled(x[i:i + 1])) for i in (0, 17, 39))
    layer = modules.Linear(560, 256, bias=True).bfloat16()
    layer.prepare()
    x = torch.randn(40, 560).bfloat16()
    if kernels.GEMM_IN_FLOAT32:
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    else:
        expected = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)


def test_a_step_gives_the_same_bits_on_any_number_of_threads(smollm2):
    """Decoding may drop a thread while another process keeps a core busy (threads.ThreadSizer): every output of a
    few-row step is summed by one thread, so 1 and 2 threads give the same logits, bit for bit."""
    ckpt, _ = smollm2
    m = load_model(ckpt, "cpu", torch.bfloat16)
    m.setup_caches(1, 256)
    most = torch.get_num_threads()
    with torch.no_grad():
        m(torch.arange(100, 140)[None], torch.arange(40)[None], torch.tensor([[39]]))
        results = []
        for threads in (1, max(most, 2)):
            torch.set_num_threads(threads)
            results.append(m(torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(40, 45)[None]))
    torch.set_num_threads(most)
    assert torch.equal(*results)


def qk_norm_forward(self, x, cos, sin, mask, input_pos):
    """model.Attention.forward as a fork adding QK-norm (Qwen3) writes it: each head's q and k RMS-normed before
    rotary."""
    B, T, _ = x.shape
    hd, r = self.args.head_dim, self.args.rotary_dim

    def norm(t):
        return (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)
    q = model.apply_rotary(norm(self.wq(x).view(B, T, self.n_heads, hd)), cos, sin, r)
    k = model.apply_rotary(norm(self.wk(x).view(B, T, self.n_kv_heads, hd)), cos, sin, r)
    v = self.wv(x).view(B, T, self.n_kv_heads, hd)
    k, v = self.kv_cache.update(input_pos, k, v)
    groups = self.n_heads // self.n_kv_heads
    q = q.transpose(1, 2).reshape(B, self.n_kv_heads, groups * T, hd)
    y = self.attend(q, k, v, mask, input_pos)
    return self.wo(y.view(B, self.n_heads, T, hd).transpose(1, 2).reshape(B, T, self.n_heads * hd))


def warnings_in(err: str) -> str:
    """stderr without the line that says the backend is checking itself (printed once per model and code)."""
    return "".join(line for line in err.splitlines(True) if not line.startswith("CPU backend: checking"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_fork_that_changes_model_py_gets_model_py(smollm2, monkeypatch, capsys, dtype):
    """model.py's Attention.forward edited in place to add QK-norm, which the one-call step does not do: the backend
    says so in one line, turns its one-call step off, and steps run the fork's forward: its attention as model.py's
    code around the backend's products and attention, the rest of each layer in a few_rows.cpp call. Checked
    against the fork on --backend torch: float32 the same greedy tokens, bf16 logits within the canary's 5% RMS
    (both far from the unforked model's)."""
    ckpt, _ = smollm2
    prompt = Tokenizer(ckpt).encode("def fibonacci(n):")
    reference = load_model(ckpt, "cpu", dtype, backend="torch")
    unforked = generate(reference, [prompt], 16, Steps())[0]
    monkeypatch.setattr(model.Attention, "forward", qk_norm_forward)
    capsys.readouterr()
    forked = load_model(ckpt, "cpu", dtype)
    assert re.fullmatch(r"warning: CPU backend: model.Attention.forward is not the math its one-call step implements: "
                        r"its syntax tree at test_cpu.py:\d+ differs from the shipped one's in more than comments, "
                        r"layout or the names of locals; steps run model.py's forward, its attention as model.py's "
                        r"code, the rest in few_rows.cpp's calls\n", warnings_in(capsys.readouterr().err))
    assert not backend.report(forked).one_call_step and type(forked.layers[0].attention) is modules.Attention
    assert [type(m) for m in (forked.layers[0], forked.layers[0].feed_forward)] == [one_call.Halves,
                                                                                    one_call.FeedForwardBlock]
    ours, theirs = generate(forked, [prompt], 16, Steps())[0], generate(reference, [prompt], 16, Steps())[0]
    assert ours != unforked
    if dtype == torch.float32:
        assert ours == theirs
    tokens = torch.tensor([prompt + ours[0]])
    with torch.no_grad():
        logits = [m(tokens, torch.arange(tokens.shape[1])[None]).float() for m in (forked, reference)]
    assert ((logits[0] - logits[1]).pow(2).mean() / logits[1].pow(2).mean()).sqrt() < 0.05


def defined(source: str):
    """The function a fork's edited model.py would define from `source` (in model.py's namespace, with its source
    readable, as the backend's fingerprints read it)."""
    source = textwrap.dedent(source)
    filename = f"<fork of model.py {hashlib.sha256(source.encode()).hexdigest()[:8]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {}
    exec(compile(source, filename, "exec"), vars(model), namespace)
    return next(iter(namespace.values()))


def test_an_edit_that_keeps_the_math_keeps_the_one_call_step(monkeypatch, capsys):
    """Attention.forward with its locals renamed (hd -> D, y -> out), a tuple assignment split in two, an alias
    (width = D) and a comment: the same math, so the same fingerprint, and the one-call step serves, no warning."""
    source = textwrap.dedent(inspect.getsource(model.Attention.forward))
    renamed = re.sub(r"\by\b", "out", re.sub(r"\bhd\b", "D", source))
    renamed = renamed.replace("    D, r = self.args.head_dim, self.args.rotary_dim\n",
                              "    D = self.args.head_dim\n    r = self.args.rotary_dim  # the rotated dims\n")
    renamed = renamed.replace("    groups = self.n_heads // self.n_kv_heads\n",
                              "    groups = self.n_heads // self.n_kv_heads\n    width = D\n")
    renamed = renamed.replace("groups * T, D)", "groups * T, width)")
    assert renamed.count("width") == 2 and "hd" not in renamed and "D = self.args.head_dim\n" in renamed
    forward = defined(renamed)
    assert cpu.fingerprints.fingerprint(forward) == cpu.gate.ONE_CALL["model.Attention.forward"][0]
    monkeypatch.setattr(model.Attention, "forward", forward)
    capsys.readouterr()
    m = served_model(torch.bfloat16)
    assert backend.report(m).one_call_step and isinstance(m.one_call_step, one_call.OneCallStep)
    assert warnings_in(capsys.readouterr().err) == ""


def test_modules_and_config_fields_it_does_not_implement_are_refused(capsys):
    """A subclass of a module it would run (here QK-norm as a fork's Attention subclass) or a config field it does
    not know (the flag a fork adds to ModelArgs): refused in one line before anything is served."""
    import dataclasses

    class QKNormAttention(model.Attention):
        forward = qk_norm_forward

    @dataclasses.dataclass
    class ForkArgs(model.ModelArgs):
        qk_norm: bool = True

    args = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)
    subclassed = model.Transformer(model.ModelArgs(**args))
    for layer in subclassed.layers:
        layer.attention.__class__ = QKNormAttention
    flagged = model.Transformer(ForkArgs(**args))
    for m, message in ((subclassed, "module layers.0.attention is a QKNormAttention, not a type it implements"),
                       (flagged, "config field 'qk_norm' is not one it implements")):
        capsys.readouterr()
        assert cpu.apply(m.eval()).name == "torch"
        warning = f"warning: CPU backend: {message}; the model runs on model.py's PyTorch path\n"
        assert warnings_in(capsys.readouterr().err) == warning
        assert not any(type(x).__module__ == modules.__name__ for x in m.modules())


def test_backend_and_pytorch_give_the_same_float32_tokens(smollm2):
    """SmolLM2 in float32 on the README's demo prompt, 128 greedy tokens: --backend auto (few_rows.cpp) and
    --backend torch (model.py alone) agree token for token. (In bf16 they part at the first near-tie, here token 25:
    their products sum in another order and round to bf16 differently; the canary holds them within 5% RMS.)"""
    ckpt, _ = smollm2
    prompt = Tokenizer(ckpt).encode("def fibonacci(n):")
    runs = []
    for name in ("auto", "torch"):
        m = load_model(ckpt, "cpu", torch.float32, backend=name)
        assert backend.report(m).one_call_step == (name == "auto")
        runs.append(generate(m, [prompt], 128, Steps())[0])
    assert runs[0] == runs[1]


def test_the_functions_its_kernels_replace_are_the_ones_it_implements():
    """The backend's products and attention replace model.py's attend and quantize.py's forwards, dequantize and
    round_activations outright, so no canary comparison of its own would see an edit to them, and the one-call step
    re-implements model.py's forward, which the canary sees only at its few positions: it holds a fingerprint of
    each. Failing here means one was edited: change the kernels (or the one-call step) to match, then the
    fingerprint and source hash in cpu.gate.REPLACED (or cpu.gate.ONE_CALL), as printed."""
    for table in (cpu.gate.REPLACED, cpu.gate.ONE_CALL):
        now = {name: (fingerprints.fingerprint(function_named(name)), fingerprints.source_hash(function_named(name)))
               for name in table}
        assert now == table, "\n".join(f"{name!r}: {value}," for name, value in now.items())


def function_named(name: str):
    target = {"model": model, "quantize": quantize}[name.split(".")[0]]
    for part in name.split(".")[1:]:
        target = getattr(target, part)
    return target


def interpreters() -> list[Path]:
    """Every CPython 3.10+ this machine has besides the one running the tests: pyenv's versions."""
    found = []
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for python in sorted(root.glob("*/bin/python3")):
        version = re.fullmatch(r"3\.(\d+)\.\d+", python.parent.parent.name)
        if version and int(version.group(1)) >= 10 and python.resolve() != Path(sys.executable).resolve():
            found.append(python)
    return found


def test_every_cpython_computes_the_same_fingerprints():
    """The gate's verdict does not depend on the interpreter: every other CPython found here (pyenv's 3.10, 3.12,
    3.13 on these machines; no torch needed) computes each function's fingerprint from model.py and quantize.py
    as the table has it (ast.dump's text differs between them: 3.13 leaves out empty fields)."""
    found = interpreters()
    if not found:
        pytest.skip("no other CPython 3.10+ on this machine (looked in $PYENV_ROOT/versions)")
    names = list(cpu.gate.REPLACED) + list(cpu.gate.ONE_CALL)
    script = ("import importlib.util, json, sys\n"
              "spec = importlib.util.spec_from_file_location('fingerprints', 'cpu/fingerprints.py')\n"
              "f = importlib.util.module_from_spec(spec); spec.loader.exec_module(f)\n"
              "print(json.dumps({n: f.fingerprint_in_file(n.split('.')[0] + '.py', n.split('.', 1)[1]) "
              "for n in json.loads(sys.argv[1])}))")
    expected = {name: (cpu.gate.REPLACED | cpu.gate.ONE_CALL)[name][0] for name in names}
    for python in found:
        out = subprocess.run([python, "-I", "-c", script, json.dumps(names)], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=300).stdout
        assert json.loads(out) == expected, python


def test_the_shipped_source_is_never_called_edited(monkeypatch, capsys):
    """Should an interpreter ever parse the shipped source into another tree (a stale math fingerprint here), the
    shipped source still serves: its text is the shipped one's, so nothing is called edited, no warning."""
    replaced, one_call = cpu.gate.REPLACED, cpu.gate.ONE_CALL
    monkeypatch.setitem(replaced, "model.Attention.attend", ("0" * 16, replaced["model.Attention.attend"][1]))
    monkeypatch.setitem(one_call, "model.RMSNorm.forward", ("0" * 16, one_call["model.RMSNorm.forward"][1]))
    assert cpu.gate.edited(cpu.gate.REPLACED) == [] and cpu.gate.edited(cpu.gate.ONE_CALL) == []
    capsys.readouterr()
    m = served_model(torch.bfloat16)
    assert backend.report(m).one_call_step and warnings_in(capsys.readouterr().err) == ""


def test_an_edit_to_attend_leaves_only_attend_to_model_py(monkeypatch, capsys):
    """A fork caps attention's logits in model.Attention.attend (as Gemma 2 does), which few_rows.cpp's attention
    does not: one line says so, and only attend leaves the kernels: q/k/v, rotary and the cache writes are one
    few_rows.cpp call, the fork's attend runs as model.py's code, the output product and the MLP are calls of their
    own. Its logits are the fork's on model.py's PyTorch path (float32: within 1e-5 of the largest)."""
    def capped_attend(self, q, k, v, mask, input_pos):
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).float()
        scores = (50 * torch.tanh(scores / 50)).masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1).to(q.dtype) @ v)
    monkeypatch.setattr(model.Attention, "attend", capped_attend)
    torch.manual_seed(0)
    m = model.Transformer(model.ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                          intermediate_size=96)).eval()
    reference = model.Transformer(m.args).eval()
    reference.load_state_dict(m.state_dict())
    capsys.readouterr()
    assert cpu.apply(m).name == "cpu"
    assert re.fullmatch(r"warning: CPU backend: model.Attention.attend is not the math its kernels implement: its "
                        r"syntax tree at test_cpu.py:\d+ differs from the shipped one's in more than comments, layout "
                        r"or the names of locals; steps run model.py's forward, its attend as model.py's code, the "
                        r"rest in few_rows.cpp's calls\n", warnings_in(capsys.readouterr().err))
    assert [type(x) for x in (m.layers[0], m.layers[0].attention, m.layers[0].feed_forward)] == [
        one_call.Halves, one_call.AttendAround, one_call.FeedForwardBlock]
    assert "its attend as model.py's code" in backend.report(m).serves
    for x in (m, reference):
        x.setup_caches(1, 32)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        expected = reference(tokens, torch.arange(8)[None])
        m(tokens[:, :3], torch.arange(3)[None])  # a prompt through model.py's code, then steps through the kernels
        got = torch.cat([m(tokens[:, 3:4], torch.tensor([[3]])), m(tokens[:, 4:], torch.arange(4, 8)[None])], 1)
    assert (got - expected[:, 3:]).abs().max() <= 1e-5 * expected.abs().max()


def test_an_edit_to_model_py_s_forward_turns_the_one_call_step_off(monkeypatch, capsys):
    """A fork windows attention in Transformer.forward's mask (only past position 1000: the canary never gets
    there): the backend's one-call step does not know it, so it is off and steps run model.py's forward, with the
    window, around the backend's products and attention (the MLP and norms each a few_rows.cpp call)."""
    source = inspect.getsource(model.Transformer.forward)
    windowed = source.replace("mask = slots <= input_pos[:, None, :, None]",
                              "mask = (slots <= input_pos[:, None, :, None]) & "
                              "(slots > input_pos[:, None, :, None] - 1000)")
    assert windowed != source
    monkeypatch.setattr(model.Transformer, "forward", defined(windowed))
    capsys.readouterr()
    m = served_model(torch.bfloat16)
    assert not backend.report(m).one_call_step and type(m.layers[0].attention) is modules.Attention
    assert re.fullmatch(r"warning: CPU backend: model.Transformer.forward is not the math its one-call step "
                        r"implements: its syntax tree at <fork of model.py \w+>:1 differs from the shipped one's in "
                        r"more than comments, layout or the names of locals; steps run model.py's forward, its "
                        r"attention as model.py's code, the rest in few_rows.cpp's calls\n",
                        warnings_in(capsys.readouterr().err))


def test_bf16_tiles_are_a_product_s_only_copy_and_restore_gives_model_py_its_weights_back():
    """A served bf16 product holds its weight only in its column tiles (its weight is on the meta device: no
    memory), but where an embedding shares it; restoring the model gives model.py every weight back bit for bit, and
    every module its class and attributes (the step for an edited MLP included)."""
    from cpu.serving import restore, serve
    assert kernels.load()
    for tie, edited in ((False, set()), (True, set()), (False, {"model.FeedForward.forward"})):
        torch.manual_seed(0)
        m = model.Transformer(model.ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                              intermediate_size=96, tie_embeddings=tie)).to(torch.bfloat16).eval()
        before = {name: t.clone() for name, t in m.state_dict().items()}
        products = [p for p in m.modules() if type(p) is torch.nn.Linear]
        originals, parts = serve(m, products, {})
        parts.install(edited)  # an edited MLP: ModelPyMlp's classes and the MLP's submodules in its instance dict
        assert all(p.weight.is_meta for p in products if p is not m.output)
        assert m.output.weight.is_meta != tie and not m.tok_embeddings.weight.is_meta
        restore(m, originals, parts)
        assert type(m) is model.Transformer and "one_call_step" not in vars(m)
        assert all(type(p) is torch.nn.Linear and not {"looked_up", "deferred_by"} & set(vars(p)) for p in products)
        assert not any({"w1", "w2", "w3"} & set(vars(layer.feed_forward)) for layer in m.layers)
        after = m.state_dict()
        assert all(torch.equal(before[name], after[name]) for name in before if "cache" not in name), tie


def test_the_canary_s_bound_is_twice_the_model_s_own_noise_where_that_is_larger(monkeypatch, tmp_path):
    """A deep model of random weights has nearly flat logits, which one unit in the last place at every layer moves as
    far as the backend's other order of sums does (the 1.5B's shapes in int4: 0.065 and 0.063 RMS, over the fixed
    bound 0.05, and the backend was refused for a correct kernel). The bound is twice that noise floor where it
    exceeds TOLERANCE: here TOLERANCE is set below both, so the floor alone lets the backend serve; without the floor
    the same model is refused. A real model's floor stays under the fixed bound (SmolLM2 int4: 0.023)."""
    import cpu.canary as canary
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(canary, "TOLERANCE", 1e-4)
    floors = []
    measured = canary.noise_floor
    monkeypatch.setattr(canary, "noise_floor", lambda *args: floors.append(measured(*args)) or floors[-1])
    assert served_model(torch.bfloat16) is not None and floors and floors[0] > 1e-3
    monkeypatch.setattr(canary, "noise_floor", lambda *args: 0.0)
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "without the floor"))  # not the verdict remembered above
    torch.manual_seed(0)
    m = model.Transformer(model.ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                          intermediate_size=96))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    assert cpu.apply(m.to(torch.bfloat16).eval()).name == "torch"


def test_the_canary_catches_what_the_fingerprints_let_through(monkeypatch, capsys):
    """The canary's second line of defence: QK-norm edited into Attention.forward with its fingerprint updated as if
    the one-call step implemented it (it does not): the one-call step's logits differ from model.py's forward, so
    the backend says so in one line and turns the one-call step off; the fork's forward runs around the kernels
    (which the canary checked against PyTorch), and that verdict is remembered with it."""
    monkeypatch.setattr(model.Attention, "forward", qk_norm_forward)
    monkeypatch.setitem(cpu.gate.ONE_CALL, "model.Attention.forward",
                        (fingerprints.fingerprint(qk_norm_forward), fingerprints.source_hash(qk_norm_forward)))
    capsys.readouterr()
    for _ in range(2):  # checked, then remembered
        torch.manual_seed(0)
        m = model.Transformer(model.ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                              intermediate_size=96)).to(torch.bfloat16).eval()
        assert cpu.apply(m).name == "cpu"
        assert type(m.layers[0].attention) is modules.Attention and type(m) is model.Transformer
        assert not backend.report(m).one_call_step
    assert re.fullmatch(r"warning: CPU backend: its one-call step differs from model.py's forward by \S+ \(bound 0\); "
                        r"steps run model.py's forward around its kernels\n"
                        r"warning: CPU backend: its one-call step differs from model.py's forward by \S+ \(bound 0\) "
                        r"\(remembered from its check\); steps run model.py's forward around its kernels\n",
                        warnings_in(capsys.readouterr().err))
