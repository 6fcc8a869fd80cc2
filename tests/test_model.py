"""model.py against transformers (random-weight configs, no download), and its own cache/position semantics."""
import pytest
import torch

from generate import load_model
from model import few_rows_linear

TOL = 1e-4  # fp32 max abs logit difference allowed against transformers


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama3_rope_scaling", "codegen_partial_rotary"])
def test_logits_match_transformers_prefill_and_16_decode_steps(tiny, name):
    ckpt, hf = tiny(name)
    model = load_model(ckpt, "cpu", torch.float32)
    model.setup_caches(1, 64)
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (1, 12 + 16))
    with torch.no_grad():
        ref = hf(tokens[:, :12], use_cache=True)
        ours = model(tokens[:, :12], torch.arange(12)[None])
        assert (ours - ref.logits).abs().max().item() < TOL
        past = ref.past_key_values
        for step in range(16):
            pos = 12 + step
            ref = hf(tokens[:, pos:pos + 1], past_key_values=past, use_cache=True)
            past = ref.past_key_values
            ours = model(tokens[:, pos:pos + 1], torch.tensor([[pos]]))
            assert (ours - ref.logits).abs().max().item() < TOL, f"decode step {step}"


def test_llama3_scaling_changes_frequencies(tiny):
    """Guards the parity test above: the tiny config must actually exercise the scaled regime."""
    from model import ModelArgs, rope_frequencies
    ckpt, _ = tiny("llama3_rope_scaling")
    args = ModelArgs.from_config(ckpt / "config.json")
    plain = ModelArgs(**{**args.__dict__, "rope_scaling": None})
    scaled, unscaled = rope_frequencies(args, "cpu"), rope_frequencies(plain, "cpu")
    ratio = unscaled / scaled
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


@pytest.mark.parametrize("name", ["llama_gqa_tied", "codegen_partial_rotary"])
def test_ragged_rows_and_verify_shaped_forward_match_single_row_decode(tiny, name):
    """Rows at different positions in one batch, and a K+1-token forward at an arbitrary position, give the
    logits of plain one-token decoding of each row alone."""
    ckpt, _ = tiny(name)
    model = load_model(ckpt, "cpu", torch.float32)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 256, (n,)) for n in (20, 24)]

    def sequential(seq):
        model.setup_caches(1, 64)
        return torch.cat([model(seq[None, i:i + 1], torch.tensor([[i]])) for i in range(len(seq))], 1)[0]

    expected = [sequential(s) for s in seqs]
    with torch.no_grad():
        # A batch of 2: row 0 has 5 prompt tokens, row 1 has 12, right-padded; then both decode the rest.
        model.setup_caches(2, 64)
        lengths = [5, 12]
        prompt = torch.zeros(2, 12, dtype=torch.long)
        for b, n in enumerate(lengths):
            prompt[b, :n] = seqs[b][:n]
        logits = model(prompt, torch.arange(12).expand(2, 12))
        for b, n in enumerate(lengths):
            torch.testing.assert_close(logits[b, :n], expected[b][:n], rtol=0, atol=1e-5)
        # Verify-shaped: 4 tokens at once at each row's own position.
        pos = torch.stack([torch.arange(n, n + 4) for n in lengths])
        block = torch.stack([seqs[b][n:n + 4] for b, n in enumerate(lengths)])
        logits = model(block, pos)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(logits[b], expected[b][n:n + 4], rtol=0, atol=1e-5)
        # Then one-token decode continues from there; the padded slots were overwritten, never seen.
        for step in range(4):
            pos = torch.tensor([[n + 4 + step] for n in lengths])
            tok = torch.stack([seqs[b][n + 4 + step:n + 5 + step] for b, n in enumerate(lengths)])
            logits = model(tok, pos)
            for b, n in enumerate(lengths):
                torch.testing.assert_close(logits[b, 0], expected[b][n + 4 + step], rtol=0, atol=1e-5)


def stacked_model(dtype, family="llama", **overrides):
    """A random model with q/k/v and gate/up stacked as load_model stacks them (FusedProducts)."""
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    sizes = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)
    model = Transformer(ModelArgs(**{**sizes, **overrides}, family=family))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype).eval()
    for block in model.layers:
        block.fuse_products()
    return model


@torch.no_grad()
def one_call_and_forward(model, tokens, positions):
    """(logits, k and v caches after) of one step run as one few_rows.cpp call, then of the same step from the same
    cache through model.py's forward in PyTorch."""
    assert model.step_in_one_call(tokens)
    caches = [layer.attention.kv_cache for layer in model.layers]
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
    results = []
    for operands in (model.one_call_operands, None):
        for c, (k, v) in zip(caches, before):
            c.k_cache.copy_(k)
            c.v_cache.copy_(v)
        kept, model.one_call_operands = model.one_call_operands, operands
        logits = model(tokens, positions)
        model.one_call_operands = kept
        results.append((logits, [c.k_cache.clone() for c in caches], [c.v_cache.clone() for c in caches]))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_in_one_call_computes_what_forward_computes(dtype):
    """few_rows.cpp's llama_step against model.py's forward in PyTorch from the same cache, with q/k/v biases
    (Qwen2), grouped KV heads and rotary on part of each head: a decode (2 rows), a verify (2 x 5) and 2 x 8 rows
    at positions far apart. bf16: it rounds where eager PyTorch rounds and sums RMSNorm's squares in PyTorch's
    order, so the logits and the cache entries it writes are the same bits; float32: within 1e-5 (PyTorch sums
    several rows' squares in another order than one row's)."""
    model = stacked_model(dtype, qkv_bias=True, rotary_dim=8)
    model.setup_caches(2, 64)
    torch.manual_seed(1)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 20)), torch.arange(20).expand(2, 20), torch.tensor([[19], [12]]))
    tolerance = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for tokens, positions in [(torch.tensor([[7], [9]]), torch.tensor([[20], [13]])),
                              (torch.randint(0, 256, (2, 5)), torch.tensor([[21], [14]]) + torch.arange(5)),
                              (torch.randint(0, 256, (2, 8)), torch.tensor([[30], [3]]) + torch.arange(8))]:
        one_call, forward = one_call_and_forward(model, tokens, positions)
        torch.testing.assert_close(one_call, forward, **tolerance)


def test_smollm2_bf16_steps_in_one_call_are_eager_pytorch_bit_for_bit(smollm2):
    """Real weights, bf16: 24 decode steps of random tokens and a 5-row verify from the same cache states, one call
    against model.py's forward in eager PyTorch: the same logits, bit for bit. (With RMSNorm's squares summed in
    sequence instead of in PyTorch's order, 18 of 40 such steps were.)"""
    ckpt, _ = smollm2
    model = load_model(ckpt, "cpu", torch.bfloat16)
    model.setup_caches(1, 256)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randint(0, 49152, (1, 80), generator=generator), torch.arange(80)[None], torch.tensor([[79]]))
    for i in range(25):
        rows = 5 if i == 24 else 1
        tokens = torch.randint(0, 49152, (1, rows), generator=generator)
        (one_call, *_), (forward, *_) = one_call_and_forward(model, tokens, torch.arange(80 + i, 80 + i + rows)[None])
        assert torch.equal(one_call, forward), (i, (one_call.float() - forward.float()).abs().max())


def test_a_step_runs_in_one_call_only_where_it_can():
    """Llama-family few-row steps on CPU in bf16 or float32 run as one call, and a compiled step then compiles
    nothing, whatever the number of rows (a verify of K = 32 and batch rows included); a position past the cache
    is refused, not written; prompts (logits of chosen positions), more than 33 tokens a row, CodeGen, fp16 and
    unstacked layers take model.py's forward."""
    from generate import CompiledStep, decode_one_token
    from torch._dynamo.utils import counters
    model = stacked_model(torch.bfloat16)
    model.setup_caches(16, 64)
    assert model.step_in_one_call(torch.zeros(1, 33)) and model.step_in_one_call(torch.zeros(40, 1))
    assert not model.step_in_one_call(torch.zeros(1, 34))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    step = CompiledStep(decode_one_token)
    with torch.no_grad():
        step(model, torch.arange(16) % 7, torch.zeros(16, dtype=torch.long), 0.0, None, None)
        assert counters["stats"]["unique_graphs"] == graphs
        # torch.compile of forward itself traces the call as one op (its fake implementation gives the shape)
        tokens, positions = torch.arange(16)[:, None], torch.ones(16, 1, dtype=torch.long)
        compiled = torch.compile(model.forward, fullgraph=True)(tokens, positions)
        assert torch.equal(compiled, model(tokens, positions))
        with pytest.raises(RuntimeError, match="position 64 is outside the cache of 64"):
            model(tokens, positions * 64)
    for other in (stacked_model(torch.bfloat16, family="codegen"), stacked_model(torch.float16),
                  stacked_model(torch.float32, n_layers=3)):
        if other.args.n_layers == 3:
            other.layers[2].attention.wqkv = None  # one layer's q/k/v as three products
        other.setup_caches(1, 64)
        assert other.one_call_operands is None


def few_rows_cases():
    """Each weight layout few_rows.cpp reads: (product of x [M, 1536] (some cases: its first 1504 or 1520
    columns), the float weight it stands for, the inputs it multiplies: x itself, x rounded to bf16 for bf16
    weights without block factors when in_features is a multiple of 32 and for packed MX 6-bit codes, or for int4
    x rounded to 8 bits per block of 32)."""
    torch.manual_seed(0)
    n, k = 203, 1536  # n not a multiple of the 16 weight rows product() hands each tile call
    w = torch.randn(n, k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    per_channel, per_block = torch.rand(n) + 0.5, torch.rand(n, k // 32) + 0.5
    import quantize
    int4 = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.stack([torch.rand(k // 64, n) + 0.5, torch.randn(k // 64, n)], -1).bfloat16()
    nibbles, group_factors = quantize.int4_runtime(int4, scales_and_zeros)
    scale, offset = (t.repeat_interleave(64, 1) for t in group_factors.unbind(-1))
    # groups of 32 and an odd number of 32-element blocks: the last one alone in its 16 bytes
    int4_odd = int4[:, :-32].contiguous()
    odd_nibbles, odd_factors = quantize.int4_runtime(int4_odd, torch.stack(
        [torch.rand(k // 32 - 1, n) + 0.5, torch.randn(k // 32 - 1, n)], -1).bfloat16())
    odd_scale, odd_offset = (t.repeat_interleave(32, 1) for t in odd_factors.unbind(-1))
    import mx
    fp6 = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    e8m0 = torch.randint(120, 135, (n, k // 32), dtype=torch.uint8)
    packed = {f: (mx.pack(fp6, 6), quantize.code_table(mx.FORMATS[f]), mx.dequantize(fp6, e8m0, mx.FORMATS[f]))
              for f in ("fp6_e2m3", "fp6_e3m2")}
    x = torch.randn(33, k)  # up to a verify of K = 32
    x[3, 32:64] = 0  # an all-zero block
    same = lambda x: x  # noqa: E731
    return x, {
        # MX 6-bit codes as packed in the file, one E8M0 scale per 32; inputs rounded to bf16, as for bf16 pairs
        **{f"{f} packed": (lambda x, c=c, t=t: few_rows_linear(x, c, e8m0, t), w,
                           lambda x: x.bfloat16().float()) for f, (c, t, w) in packed.items()},
        # in_features an odd number of 32-element blocks: the last one alone
        "fp6_e2m3 packed, K % 64 = 32": (
            lambda x: few_rows_linear(x[:, :-32].contiguous(), mx.pack(fp6[:, :-32], 6), e8m0[:, :-1].contiguous(),
                                      packed["fp6_e2m3"][1]),
            packed["fp6_e2m3"][2][:, :-32], lambda x: x[:, :-32].bfloat16().float()),
        "fp32": (lambda x: few_rows_linear(x, w), w, same),
        # bf16 weights multiply the inputs rounded to bf16 (a bf16 model's are already), in pairs (vdpbf16ps)
        "bf16": (lambda x: few_rows_linear(x, w.bfloat16()), w.bfloat16().float(),
                 lambda x: x.bfloat16().float()),
        "bf16 x channel": (lambda x: few_rows_linear(x, w.bfloat16(), per_channel),
                           w.bfloat16().float() * per_channel[:, None], lambda x: x.bfloat16().float()),
        # in_features not a multiple of 32: no pairs, each bf16 weight to float times x itself
        "bf16, K % 32 = 16": (lambda x: few_rows_linear(x[:, :-16].contiguous(), w[:, :-16].bfloat16()),
                              w[:, :-16].bfloat16().float(), lambda x: x[:, :-16]),
        "bf16 x block": (lambda x: few_rows_linear(x, w.bfloat16(), per_block),
                         w.bfloat16().float() * per_block.repeat_interleave(32, 1), same),
        "int8 x channel": (lambda x: few_rows_linear(x, codes, per_channel), codes * per_channel[:, None],
                           same),
        "int8 x block": (lambda x: few_rows_linear(x, codes, per_block),
                         codes * per_block.repeat_interleave(32, 1), same),
        "int4 x group": (lambda x: few_rows_linear(x, nibbles, group_factors), int4 * scale + offset,
                         quantize.round_activations),
        "int4 x group of 32, K % 64 = 32": (
            lambda x: few_rows_linear(x[:, :-32].contiguous(), odd_nibbles, odd_factors),
            int4_odd * odd_scale + odd_offset, lambda x: quantize.round_activations(x[:, :-32])),
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
    outputs = {(name, rows): product(x[:rows].contiguous()) for name, (product, _, _) in cases.items()
               for rows in (1, 5, 16)}
    for dtype in (torch.float32, torch.bfloat16):
        for groups in ATTENTION_GROUPS:
            outputs["attention", str(dtype), groups] = torch.ops.few_rows.attention(*attention_inputs(dtype, groups))
    return outputs


def test_few_rows_kernels_match_float64_and_give_every_row_the_same_arithmetic():
    """few_rows.cpp for each weight layout: within 1e-5 relative of a float64 product of the dequantized weight
    and the inputs it multiplies (float32 accumulation over K = 1536; int4: quantize.round_activations, so the
    rounding of the activations is checked too: one q off by one moves the result by ~4e-4 of its largest
    output), and a row's result is bit-identical whether it is computed alone or among 2, 3, 5, 8, 16, 17 or 33
    rows (what keeps speculative verify equal to decode at any K)."""
    import model
    assert model.build_few_rows_kernels(), "few_rows.cpp did not build (needs a C++ compiler, as torch.compile does)"
    x, cases = few_rows_cases()
    for name, (product, reference, inputs) in cases.items():
        expected = inputs(x).double() @ reference.double().T
        y = product(x)
        scale = expected.abs().max()
        assert (y.double() - expected).abs().max() / scale < 1e-5, name
        for rows in (1, 2, 3, 5, 8, 16, 17):
            assert torch.equal(product(x[-rows:].contiguous()), y[-rows:]), (name, rows)


def test_few_rows_packed_fp6_nan_scale_makes_its_outputs_nan():
    """An E8M0 scale of 0xFF (NaN) in one block of a weight row makes that row's outputs NaN, and no other."""
    import mx
    import model
    import quantize
    assert model.build_few_rows_kernels()
    torch.manual_seed(0)
    codes = torch.randint(0, 64, (3, 96), dtype=torch.uint8)
    scales = torch.full((3, 3), 127, dtype=torch.uint8)
    scales[1, 2] = mx.SCALE_NAN
    fmt = mx.FORMATS["fp6_e2m3"]
    y = few_rows_linear(torch.randn(2, 96), mx.pack(codes, 6), scales, quantize.code_table(fmt))
    assert y[:, 1].isnan().all() and not y[:, [0, 2]].isnan().any()


@pytest.mark.parametrize("groups", ATTENTION_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_attention_matches_float64_and_attends_each_row_alone(dtype, groups):
    """few_rows.cpp's attention over the cache: within float32 rounding (plus, in bf16, the output's rounding,
    at most 2^-8 relative) of float64 attention with the mask slot <= position, and each token's rows are
    bit-identical when that token is attended alone (a verify attends as a decode step would)."""
    import torch.nn.functional as F
    import model
    assert model.build_few_rows_kernels()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_argmax_is_torch_argmax(dtype):
    """few_rows.cpp's argmax (greedy decode, verify, the exponential race) gives torch.argmax's index: the first
    of tied maxima (logits rounded to integers make many ties), the first NaN wherever the maximum is, and index
    0 for a row of -inf; rows of a vocabulary's length, of fewer than 16 values, and with a tail past the 16s."""
    import model
    assert model.build_few_rows_kernels()
    torch.manual_seed(0)
    for shape in [(5, 49152), (1, 49152), (3, 7), (2, 3, 45), (4, 16)]:
        cases = [torch.randn(shape), (torch.randn(shape) * 2).round(), torch.full(shape, float("-inf"))]
        for nan_at in (0, shape[-1] // 2, shape[-1] - 1):
            x = (torch.randn(shape) * 2).round()
            x[..., nan_at] = float("nan")
            x[..., -1 - nan_at] = float("nan")
            cases.append(x)
        for x in cases:
            x = x.to(dtype)
            assert torch.equal(model.argmax(x), x.argmax(-1)), shape


def test_few_rows_ops_declare_no_default_arguments():
    """Inductor's C++ wrapper leaves out trailing arguments equal to their defaults, and the dispatcher call it
    generates then reads past the arguments it was given (torch 2.13: a segfault in the first compiled step). So
    every few_rows op spells out all its arguments."""
    import model
    assert model.build_few_rows_kernels()
    for name in ("product", "attention", "argmax"):
        schema = getattr(torch.ops.few_rows, name).default._schema
        assert schema.arguments and not any(a.has_default_value() for a in schema.arguments), str(schema)


AVX2_BUILD = """
import sys, torch
root, out = sys.argv[1:]
sys.path[:0] = [root, root + "/tests"]
import model
model.load_kernels("haswell")
from test_model import few_rows_outputs
torch.save(few_rows_outputs(), out)
"""


def test_kernel_builds_are_keyed_by_their_source():
    """A build is named by a hash of what made it (source, flags, torch, this CPU's features): two checkouts or
    versions never load or rebuild each other's."""
    import model
    source = model.KERNELS_SOURCE.read_text()
    name = model.kernels_build_name(source, "native")
    assert name.startswith("few_rows_") and name == model.kernels_build_name(source, "native")
    assert name != model.kernels_build_name(source + "\n// an edit", "native")
    assert name != model.kernels_build_name(source, "haswell")


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs an x86 CPU with AVX2")
def test_few_rows_avx2_build_gives_the_native_build_bits(tmp_path):
    """few_rows.cpp built for AVX2 (16-lane sums in two 256-bit vectors, its own tile shapes) gives the same bits
    as the build for this CPU (products and attention), so on an AVX-512 machine its AVX2 code is exercised too.
    Built in an empty cache, it says so in one line with the time it took; loaded again, it says nothing."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    import model
    assert model.build_few_rows_kernels()
    out = tmp_path / "avx2.pt"
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    first = subprocess.run([sys.executable, "-c", AVX2_BUILD, root, str(out)], capture_output=True, text=True,
                           env=env, check=True)
    assert re.fullmatch(r"building few_rows.cpp for this CPU \(-march=haswell, once per source\)\.\.\. "
                        r"done in \d+ s, cached in .*\n", first.stderr), first.stderr
    again = subprocess.run([sys.executable, "-c", AVX2_BUILD, root, str(out)], capture_output=True, text=True,
                           env=env, check=True)
    assert again.stderr == ""
    avx2, native = torch.load(out), few_rows_outputs()
    for case, y in native.items():
        assert torch.equal(avx2[case], y), case


FRAME_CHUNKS = """
import resource, sys
if sys.argv[1] == "keep":
    sys.path.insert(0, sys.argv[2])
    import model
    assert model.build_few_rows_kernels()
namespace = {}
exec("def leaf():\\n    " + "; ".join(f"v{i} = {i}" for i in range(200)), namespace)  # a 1.6 KB frame
leaf = namespace["leaf"]
def caller(n):
    for _ in range(n):
        leaf()
def at_depth(d, n):
    return at_depth(d - 1, n) if d else caller(n)
worst = 0
for d in range(200):  # one of these depths leaves leaf() no room in the caller's frame chunk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    at_depth(d, 1000)
    worst = max(worst, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(worst)
"""


def test_frame_chunks_are_kept_instead_of_mapped_per_call():
    """With few_rows.cpp loaded, a call that needs a new frame chunk reuses a kept one: 1000 such calls fault in
    fewer than 50 fresh pages. The control, plain Python (3.11+), maps and faults in a fresh chunk every call."""
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    faults = {how: int(subprocess.run([sys.executable, "-c", FRAME_CHUNKS, how, root], check=True, capture_output=True,
                                      text=True).stdout) for how in ("plain", "keep")}
    assert faults["keep"] < 50, faults
    if sys.version_info >= (3, 11):
        assert faults["plain"] >= 1000, faults


def test_fp16_few_row_steps_take_pytorch_kernels(tiny):
    """few_rows.cpp has no fp16 path: an fp16 model's decode and verify-shaped steps run PyTorch's kernels
    (they once reached the C++ dtype check and raised) and stay within 0.02 of the fp32 logits."""
    ckpt, _ = tiny("llama_gqa_tied")
    logits = {}
    for dtype in (torch.float16, torch.float32):
        model = load_model(ckpt, "cpu", dtype)
        model.setup_caches(1, 64)
        tokens = torch.tensor([[5, 17, 42, 7, 99]])
        with torch.no_grad():
            model(tokens[:, :3], torch.arange(3)[None])
            logits[dtype] = torch.cat([model(tokens[:, 3:4], torch.tensor([[3]])),  # decode, 1 row
                                       model(tokens[:, 3:], torch.tensor([[3, 4]]))], 1).float()  # 2 rows
    torch.testing.assert_close(logits[torch.float16], logits[torch.float32], rtol=0, atol=0.02)


def test_many_row_bf16_products_are_float32_products_where_the_cpu_lacks_bf16():
    """A prompt's products (more than 33 tokens a row) in bf16 on a CPU without native bf16: PyTorch's bf16 GEMM runs
    ~6x slower there than float32 (a SmolLM2 prefill took 1.4 s), so they are float32 products rounded once to
    bf16, bit for bit; elsewhere, PyTorch's bf16 GEMM."""
    import torch.nn.functional as F
    import model
    torch.manual_seed(0)
    layer = model.Linear(576, 256, bias=True).bfloat16()
    x = torch.randn(40, 576).bfloat16()
    if model.CPU_GEMM_IN_FLOAT32:
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    else:
        expected = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)


def test_a_step_gives_the_same_bits_on_any_number_of_threads(smollm2):
    """Decoding may drop a thread while another process keeps a core busy (generate.ThreadSizer): every output of a
    few-row step is summed by one thread, so 1 and 2 threads give the same logits, bit for bit."""
    ckpt, _ = smollm2
    model = load_model(ckpt, "cpu", torch.bfloat16)
    model.setup_caches(1, 256)
    most = torch.get_num_threads()
    with torch.no_grad():
        model(torch.arange(100, 140)[None], torch.arange(40)[None], torch.tensor([[39]]))
        results = []
        for threads in (1, max(most, 2)):
            torch.set_num_threads(threads)
            results.append(model(torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(40, 45)[None]))
    torch.set_num_threads(most)
    assert torch.equal(*results)
