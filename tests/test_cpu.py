"""The CPU backend (cpu/), as llama.cpp's test-backend-ops tests its backends: every kernel few_rows.cpp has (each
weight format's product, model.py's attention and rms_norm) against a float64 reference and against itself at 1 to 17
rows, bit for bit, and across builds (portable, AVX2) and thread counts; then the backend around model.py: what it
serves, what it refuses and why, and forks of model.py that run compiled around the same kernels."""
import os
import platform
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backend
import cpu
import model
import mx
import quantize
from conftest import ROOT, read_line
from cpu import kernels
from decoding import Steps, generate
from loading import load_model
from speculative import ModelDrafter, NgramDrafter
from tokenizer import Tokenizer

ROWS = backend.LONGEST_VERIFY  # a verify of K = 16
K = 1536  # in_features (the Qwen 1.5B's)
DENSE, BF16_TILES, INT8_TILES, INT4_TILES, FP6_TILES, FP6_TABLE, INT4K_TILES = range(7)  # few_rows's layouts (linear.h)
# Every format few_rows.cpp multiplies, in the layout this CPU gets (-1) and in each other one it has:
# (format, in_features, the plain module's dtype, group, layout)
PRODUCTS = {
    "bf16": ("plain", K, torch.bfloat16, None, -1),
    "bf16, K % 64 = 32": ("plain", K - 32, torch.bfloat16, None, -1),
    "bf16, K % 32 = 16": ("plain", K - 16, torch.bfloat16, None, -1),
    "bf16 by rows": ("plain", K, torch.bfloat16, None, DENSE),
    "float32": ("plain", K, torch.float32, None, -1),
    "int8": ("int8", K, None, None, -1),
    "int8, K % 64 = 32": ("int8", K - 32, None, None, -1),
    "int4, groups of 32": ("int4", K - 32, None, 32, -1),
    "int4, groups of 128": ("int4", K, None, 128, -1),
    "int4k": ("int4k", K, None, None, -1),
    "int4k, a last super-block of 7 blocks": ("int4k", K - 32, None, None, -1),
    "int4k, one short super-block": ("int4k", 96, None, None, -1),
    **{mode: (mode, K, None, None, -1) for mode in quantize.MX_MODES},
    "mxfp6, K % 64 = 32": ("mxfp6", K - 32, None, None, -1),
    "mxfp6 in 6-bit tiles": ("mxfp6", K, None, None, FP6_TILES),
    "mxfp6 in int8 tiles": ("mxfp6", K, None, None, INT8_TILES),
    "mxfp6_e3m2 as packed": ("mxfp6_e3m2", K, None, None, FP6_TABLE),
    "mxfp6_e3m2 as packed, K % 64 = 32": ("mxfp6_e3m2", K - 32, None, None, FP6_TABLE),
    "mxfp6_e3m2 by rows": ("mxfp6_e3m2", K, None, None, DENSE),
}
N = 203  # outputs: not a multiple of the 16 a column tile holds (int4, int4k: 208, their multiple)


def reference_product(case):
    """A product module of the case's format with random weights (in quantize.py's file layout)."""
    mode, k, dtype, group, _ = PRODUCTS[case]
    return product_module(mode, k, 208 if mode in ("int4", "int4k") else N, dtype, group)


def product_module(mode, k, n, dtype=None, group=None):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    if mode == "plain":
        module = nn.Linear(k, n, bias=True).to(dtype)
        with torch.no_grad():
            module.weight.copy_(w), module.bias.normal_(generator=g)
        return module
    with torch.device("meta"):
        module = quantize.quantized_linear(mode, nn.Linear(k, n, bias=True), group or 32)
    state = quantize.quantize_tensor(mode, w, group or 32)
    module.load_state_dict(dict(state, bias=torch.randn(n, generator=g)), assign=True)
    return module


def definition(module, x, layout):
    """float64: the inputs rounded as the format rounds them (integer codes: round_activations; in bf16 pairs, the
    tiles of bf16 weights and packed 6-bit codes: to bf16) times the weight its definition gives, plus the bias."""
    fmt = quantize.format_of(module)
    if fmt.code == quantize.PLAIN:
        weight = module.weight.double()
    elif fmt.code == quantize.INT8:
        weight = module.weight.double() * module.scales.double()[:, None]
    else:
        weight = module.dequantize().double()
    if fmt.levels:
        x = quantize.round_activations(x.float(), fmt.levels)
    elif layout in (BF16_TILES, FP6_TABLE):
        x = x.bfloat16()
    return x.double() @ weight.T + module.bias.double()


def served(module, layout=-1):
    return cpu.Linear(module, quantize.format_of(module), layout)


@pytest.mark.parametrize("case", PRODUCTS)
def test_every_format_s_product_is_its_definition_and_every_row_is_computed_alone(case):
    """Each format's product on few_rows.cpp, in the layout this CPU gets: float32 inputs within float32 accumulation
    (1e-5 of the largest output) of a float64 product of the format's definition (the activations rounded as the
    format rounds them: one int8 code off by one moves the result by ~4e-4); and in bf16, as a model runs it, every
    row of 1 to 17 bit for bit what that row gives alone, whatever the number of rows."""
    assert kernels.load()
    assert_definition_and_rows(reference_product(case), PRODUCTS[case][-1])


def assert_definition_and_rows(module, layout=-1):
    kernel = served(module, layout)
    x = torch.randn(1, ROWS, module.in_features, generator=torch.Generator().manual_seed(1))
    x[0, 3, 32:64] = 0  # an all-zero block
    with torch.no_grad():
        want = definition(module, x, kernel.layout)
        got = kernel(x)
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (got.double() - want).abs().max()
        rows = x.bfloat16()
        together = kernel(rows)
        assert together.dtype == torch.bfloat16
        for n in range(1, ROWS + 1):
            assert torch.equal(kernel(rows[:, :n]), together[:, :n]), n
            assert torch.equal(kernel(rows[:, n - 1:n]), together[:, n - 1:n]), n
        # a prompt's rows (more than a step's): the same rows, bit for bit, where the layout computes every row alike;
        # plain weights' take PyTorch's GEMM, within a rounding to bf16 of the definition
        prompt = kernel(torch.cat([rows] * 3, 1))
        if kernel.layout in (DENSE, BF16_TILES):
            want = definition(module, rows, kernel.layout)
            assert (prompt[:, :ROWS].double() - want).abs().max() <= 2 ** -8 * want.abs().max()
        else:
            assert torch.equal(prompt[:, :ROWS], together)


# The real models' shapes, as their converted config.json files give them (scripts/fetch_demo.py, fetch_models.py)
REAL_MODELS = {
    "SmolLM2-135M": dict(dim=576, n_heads=9, n_kv_heads=3, intermediate_size=1536, norm_eps=1e-5, max_seq_len=8192),
    "Qwen2.5-Coder-0.5B": dict(dim=896, n_heads=14, n_kv_heads=2, intermediate_size=4864, norm_eps=1e-6,
                               max_seq_len=32768, qkv_bias=True),
    "Qwen2.5-Coder-1.5B": dict(dim=1536, n_heads=12, n_kv_heads=2, intermediate_size=8960, norm_eps=1e-6,
                               max_seq_len=32768, qkv_bias=True),
    "Gemma-3-270M": dict(family="gemma3", dim=640, n_heads=4, n_kv_heads=1, head_dim=256, intermediate_size=2048,
                         norm_eps=1e-6, max_seq_len=32768, qk_norm=True, query_pre_attn_scalar=256),
}
REAL_FORMATS = {"bf16": ("plain", torch.bfloat16, None), "float32": ("plain", torch.float32, None),
                "int4, groups of 32": ("int4", None, 32), "int4, groups of 128": ("int4", None, 128),
                **{mode: (mode, None, None) for mode in quantize.MODES if mode != "int4"}}


def real_args(name) -> model.ModelArgs:
    """The model's shapes in one layer and a vocabulary of 64 (what the tests below read of it)."""
    return model.ModelArgs(**dict(REAL_MODELS[name], vocab_size=64, n_layers=1))


@pytest.mark.parametrize("fmt", REAL_FORMATS)
@pytest.mark.parametrize("name", REAL_MODELS)
def test_every_format_s_product_at_a_real_model_s_widths_is_its_definition_at_every_row_count(name, fmt):
    """Each format's product at each in_features a real model has (its dim, its heads' width, its MLP's), 208 of its
    outputs (the kernels compute each 16-column tile alike): the definition and 1 to 17 rows bit for bit, as above.
    (int4 groups of 128 where the width holds whole groups.)"""
    assert kernels.load()
    mode, dtype, group = REAL_FORMATS[fmt]
    args = real_args(name)
    for k in sorted({args.dim, args.n_heads * args.head_dim, args.intermediate_size}):
        if k % (group or 32) == 0:
            assert_definition_and_rows(product_module(mode, k, 208, dtype, group))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("name", REAL_MODELS)
def test_attention_and_rms_norm_at_a_real_model_s_shapes_pass_the_load_s_check_at_every_row_count(name, dtype):
    """few_rows.cpp's attention and RMSNorm held as the load holds them (backend.check_op: the model's heads, head_dim,
    scale and eps, rows at positions spread over its whole context, RMSNorm bit for bit, attention within its own
    rounding of float32), at every row count of a step, 1 to 17."""
    assert kernels.load()
    torch.manual_seed(0)
    transformer = model.Transformer(real_args(name))
    for norm in (transformer.layers[0].attention_norm, getattr(transformer.layers[0].attention, "q_norm", None)):
        if norm is not None:
            norm.weight.data.normal_(1, 0.3)  # as a trained model's, not ones
    transformer = transformer.to(dtype)
    for op in cpu.OPS:
        for rows in range(1, ROWS + 1):
            assert backend.check_op(transformer, op, getattr(torch.ops.few_rows, op), rows) is None, (op, rows)


def test_the_kernel_s_format_codes_are_quantize_py_s():
    """Each format's code, which the kernels switch on, is declared once (quantize.Format): few_rows.cpp's are the
    same numbers."""
    assert kernels.load()
    codes = [quantize.PLAIN, quantize.INT8, quantize.INT4, quantize.MX, quantize.INT4K]
    assert list(torch.ops.few_rows.format_codes()) == codes
    assert {fmt.code for fmt in quantize.FORMATS.values()} == set(codes[1:])


def test_the_int4_layout_gives_back_every_code_in_place():
    """few_rows::layout lays int4 codes out in column tiles; the kernels' reader (Int4Tiles::code, what the scalar
    reference multiplies) gives back every code of the file in place, for even and odd numbers of 32-code blocks."""
    assert kernels.load()
    g = torch.Generator().manual_seed(0)
    for k in (32, 96, 1536, 1504):
        codes = torch.randint(0, 16, (48, k), dtype=torch.uint8, generator=g)
        layout = torch.ops.few_rows.layout(quantize.INT4, mx.pack(codes, 4), torch.zeros(k // 32, 48, 2).bfloat16(),
                                           None, 0, 0, -1)
        assert torch.equal(torch.ops.few_rows.int4_codes(layout[1]), codes), k


def test_an_mx_block_with_a_nan_scale_makes_its_row_s_outputs_nan():
    """An E8M0 scale of 0xFF (NaN) in one block of a weight row makes that row's outputs NaN, and no other."""
    assert kernels.load()
    for mode in ("mxfp6", "mxfp6_e3m2", "mxfp4", "mxfp8"):
        module = quantize.FORMATS[mode].module(96, 3, False, mode)
        module.weight = mx.pack(torch.randint(0, 1 << module.fmt.bits - 2, (3, 96), dtype=torch.uint8), module.fmt.bits)
        module.scales = torch.full((3, 3), 127, dtype=torch.uint8)
        module.scales[1, 2] = mx.SCALE_NAN
        y = served(module)(torch.randn(2, 96))
        assert y[:, 1].isnan().all() and not y[:, [0, 2]].isnan().any(), mode


TILED = [case for case in PRODUCTS if PRODUCTS[case][0] in ("int8", "int4", "int4k", "mxint8", "mxfp4", "mxfp6")
         and PRODUCTS[case][-1] in (-1, FP6_TILES, INT8_TILES)]  # the layouts of integer tiles (linear.h)


@pytest.fixture
def amx_tiles(request):
    """The products' AMX tiles set as the test asks (few_rows.amx: "emulated", Intel's pseudocode in plain code; "auto",
    the CPU's), and back to the CPU's after."""
    assert kernels.load()
    if request.param == "emulated" and not re.search(r"avx512_?vnni", kernels.cpu_features()):
        pytest.skip("tiles are emulated in builds with AVX512_VNNI only")
    said = torch.ops.few_rows.amx(request.param)
    if request.param == "auto" and not said.startswith("AMX tiles serve"):
        pytest.skip(f"no AMX tiles to run here: {said}")
    yield said
    torch.ops.few_rows.amx("auto")


@pytest.mark.parametrize("amx_tiles", ["emulated", "auto"], indirect=True)
@pytest.mark.parametrize("case", TILED)
def test_amx_tiles_give_the_vnni_kernels_bits_at_every_row_count(case, amx_tiles):
    """The integer formats' products of 2 to 17 rows (and a prompt's 40) on AMX tiles (cpu/few_rows/amx.h: the CPU's,
    where it has them, and everywhere their emulation, the instructions' pseudocode in plain code) give the VNNI
    kernels' bits, every row: a verify's rows on tiles are decode steps on VNNI, which the scalar references and the
    float64 definition hold (test_every_format_s_product_is_its_definition_and_every_row_is_computed_alone)."""
    module = reference_product(case)
    kernel = served(module, PRODUCTS[case][-1])
    assert kernel.layout in (INT8_TILES, INT4_TILES, FP6_TILES, INT4K_TILES), kernel.layout
    assert torch.ops.few_rows.paths()[kernel.layout].endswith("AMX tiles")  # what the report says
    x = torch.randn(1, 40, module.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[0, 3, 32:64] = 0  # an all-zero block
    with torch.no_grad():
        on_tiles = kernel(x)
        torch.ops.few_rows.amx("off")
        for n in (1, 2, 3, 5, 8, 9, 16, 17, 40):
            assert torch.equal(kernel(x[:, :n]), on_tiles[:, :n]), n
        assert torch.equal(torch.cat([kernel(x[:, n:n + 1]) for n in range(40)], 1), on_tiles)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64")
def test_a_build_with_amx_code_on_a_cpu_the_kernel_refuses_tiles_serves_avx_512_and_says_why(tmp_path):
    """few_rows.cpp built for Sapphire Rapids (its AMX code compiled: tdpbsud, tdpbusd, tdpbssd, ldtilecfg) asks Linux
    for tile state at first use; on a CPU without AMX the kernel refuses, and the build says so in one line, its
    report names no tiles, and nothing crashes (on an AMX CPU the tiles serve)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    script = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from cpu import kernels; "
              "kernels.build('sapphirerapids'); print(torch.ops.few_rows.amx('')); print(torch.ops.few_rows.paths()[3])")
    built = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, env=env,
                           timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    library = next((tmp_path / "extensions").glob("few_rows_*.so"))
    listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True).stdout
    assert {"tdpbsud", "tdpbusd", "tdpbssd", "ldtilecfg"} <= set(re.findall(r"\b(tdpb\w+|ldtilecfg)\b", listing))
    said, int4_path = built.stdout.splitlines()
    if "amx_tile" in kernels.cpu_features():
        assert said.startswith("AMX tiles serve") and int4_path.endswith("2+ rows on AMX tiles"), built.stdout
    else:
        assert re.fullmatch(r"AMX tiles refused by the kernel \(arch_prctl: .+\); AVX-512 serves", said), said
        assert int4_path == "int4 tiles, vpdpbusd (AVX512_VNNI)"


def test_the_kernels_refuse_what_they_do_not_take_in_one_line():
    assert kernels.load()
    kernel = served(nn.Linear(96, 32))
    with pytest.raises(RuntimeError, match="few_rows: linear takes bf16 or float32 inputs, not Half"):
        kernel(torch.randn(2, 96).half())
    with pytest.raises(RuntimeError, match="few_rows: in_features 40 is not a multiple of 16"):
        served(nn.Linear(40, 32))


ATTENTION_GROUPS = (1, 3, 5)  # query heads per KV head: the kernel takes a token's heads 3 at a time (AVX-512)


def attention_inputs(dtype, groups, tokens=ROWS, cache=63):
    """q [B, H_kv, G * T, D] (G query heads per KV head, T tokens), a cache of 63 slots and what the tokens see
    [B, T, 63], causal up to positions reaching its last slot (whose keys the kernel reads 4 slots at a time: 60..62
    are the ragged end)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 64, generator=g).to(dtype) for n in (groups * tokens, cache, cache))
    positions = torch.stack([torch.arange(10, 10 + tokens), torch.arange(cache - tokens, cache)])
    return q, k, v, model.visible_slots(positions, cache)


VISIBILITY = {  # what forks make a row see, as masks of slots s for a row at position p
    "causal": lambda s, p: s <= p,
    "window of 9": lambda s, p: (s <= p) & (s > p - 9),
    "sinks (4 slots) and a window of 6": lambda s, p: (s <= p) & ((s < 4) | (s > p - 6)),
    "prefix of 30 seen by every row": lambda s, p: (s <= p) | (s < 30),
    "every other slot": lambda s, p: (s <= p) & (s % 2 == p % 2),
}


@pytest.mark.parametrize("groups", ATTENTION_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_its_reference_and_attends_every_row_alone(dtype, groups):
    """few_rows.cpp's kernel of model.py's attention op: within float32 rounding (plus, in bf16, the output's rounding,
    at most 2^-8 relative) of float64 attention over the slots each position sees, at a scale not sqrt(D)'s (a fork's
    scale is taken); each token's rows of a 17-token step bit for bit those it gives alone or among the first n."""
    assert kernels.load()
    q, k, v, visible = attention_inputs(dtype, groups)
    y = torch.ops.few_rows.attention(q, k, v, visible, 0.1)
    expected = model.attention(q.double(), k.double(), v.double(), visible, 0.1)
    bound = expected.abs() * (2 ** -8 if dtype == torch.bfloat16 else 0) + 1e-5
    assert ((y.double() - expected).abs() <= bound).all()
    by_token = y.view(2, 3, groups, ROWS, 64)
    q_by_token = q.view(2, 3, groups, ROWS, 64)
    for t in range(ROWS):
        alone = torch.ops.few_rows.attention(q_by_token[:, :, :, t], k, v, visible[:, t:t + 1], 0.1)
        assert torch.equal(alone, by_token[:, :, :, t]), t
        first = torch.ops.few_rows.attention(q_by_token[:, :, :, :t + 1].reshape(2, 3, -1, 64), k, v,
                                             visible[:, :t + 1], 0.1)
        assert torch.equal(first.view(2, 3, groups, t + 1, 64), by_token[:, :, :, :t + 1]), t


@pytest.mark.parametrize("visibility", VISIBILITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sees_what_the_mask_shows_it(dtype, visibility):
    """What a row sees is data (model.visible_slots): windows, sinks, a prefix every row sees and gaps are each
    softmax over exactly the slots shown, within rounding of float64, and each token's rows as they are alone."""
    assert kernels.load()
    q, k, v, _ = attention_inputs(dtype, 3)
    positions = torch.stack([torch.arange(10, 10 + ROWS), torch.arange(63 - ROWS, 63)])
    visible = VISIBILITY[visibility](torch.arange(63), positions[..., None])
    y = torch.ops.few_rows.attention(q, k, v, visible, 0.1)
    expected = model.attention(q.double(), k.double(), v.double(), visible, 0.1)
    bound = expected.abs() * (2 ** -8 if dtype == torch.bfloat16 else 0) + 1e-5
    assert ((y.double() - expected).abs() <= bound).all()
    q_by_token, by_token = q.view(2, 3, 3, ROWS, 64), y.view(2, 3, 3, ROWS, 64)
    for t in range(ROWS):
        alone = torch.ops.few_rows.attention(q_by_token[:, :, :, t], k, v, visible[:, t:t + 1], 0.1)
        assert torch.equal(alone, by_token[:, :, :, t]), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_model_py_s_bit_for_bit_at_every_row_count(dtype):
    """few_rows.cpp's kernel of model.py's rms_norm op sums the squares in the order of PyTorch's own CPU sum (8-lane
    vectors, 4 sums, the cascade over chunks of 16 groups and more): its outputs are the reference's bit for bit, at
    widths below and above the cascade's and with leftover vectors and elements, and a row's are the same among 1 to 17
    rows (without the cascade a third of the Qwen 1.5B's rows got another mean)."""
    assert kernels.load()
    g = torch.Generator().manual_seed(0)
    for dim in (64, 200, 576, 896, 1000, 1536, 4096, 8960):
        weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
        x = (torch.randn(1, 300, dim, generator=g) * torch.rand(1, 300, 1, generator=g) * 20).to(dtype)
        x[0, 0, :5] = 3e3  # a few massive activations, as Qwen's
        expected = model.rms_norm(x, weight, 1e-6)
        assert torch.equal(torch.ops.few_rows.rms_norm(x, weight, 1e-6), expected), dim
        for n in (1, 2, 5, ROWS):
            assert torch.equal(torch.ops.few_rows.rms_norm(x[:, :n], weight, 1e-6), expected[:, :n]), (dim, n)


def test_the_kernels_hand_back_what_they_do_not_take():
    """Registered for model.py's ops, a kernel hands inputs it does not take (fp16; a head dim not a multiple of 16)
    to the op's reference: the op still computes what model.py defines."""
    assert kernels.load()
    cpu.serve("rms_norm", True), cpu.serve("attention", True)
    x, weight = torch.randn(3, 64).half(), torch.randn(64).half()
    assert torch.equal(torch.ops.fastdecode.rms_norm(x, weight, 1e-5), model.rms_norm(x, weight, 1e-5))
    q, k, v, visible = attention_inputs(torch.float32, 1, tokens=2)
    q, k, v = q[..., :40], k[..., :40], v[..., :40]
    assert torch.equal(torch.ops.fastdecode.attention(q, k, v, visible, 0.2), model.attention(q, k, v, visible, 0.2))


def test_few_rows_ops_declare_no_default_arguments():
    """Inductor's C++ wrapper leaves out trailing arguments equal to their defaults, and the dispatcher call it
    generates then reads past the arguments it was given (torch 2.13: a segfault in the first compiled step). So
    every few_rows op spells out all its arguments."""
    assert kernels.load()
    for name in ("linear", "attention", "rms_norm", "layout"):
        schema = getattr(torch.ops.few_rows, name).default._schema
        assert schema.arguments and not any(a.has_default_value() for a in schema.arguments), str(schema)


def test_stream_read_reads_every_word():
    """The bench's read probe touches the whole buffer: its result is the xor of every 32-bit word, so a skipped
    page or task changes it."""
    import numpy as np
    assert kernels.load()
    words = torch.randint(-2**31, 2**31 - 1, (3 * 4096 * 17 // 4,), dtype=torch.int32)
    assert torch.ops.few_rows.stream_read(words) == int(np.bitwise_xor.reduce(words.numpy()))
    with pytest.raises(RuntimeError, match="whole 4 KiB pages"):
        torch.ops.few_rows.stream_read(torch.zeros(100, dtype=torch.uint8))


def kernel_outputs():
    """What every kernel gives on fixed inputs: each product at 1, 5 and 17 rows, attention, rms_norm (the builds
    compare these bit for bit)."""
    outputs = {}
    for case in PRODUCTS:
        module = reference_product(case)
        kernel = served(module, PRODUCTS[case][-1])
        x = torch.randn(1, ROWS, module.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for rows in (1, 5, ROWS):  # (a layout each build chooses for itself: compared where they chose alike)
                outputs[case, kernel.layout, rows] = kernel(x[:, :rows])
                outputs[case, kernel.layout, rows, "bf16"] = kernel(x[:, :rows].bfloat16())
    for dtype in (torch.float32, torch.bfloat16):
        for groups in ATTENTION_GROUPS:
            q, k, v, visible = attention_inputs(dtype, groups)
            outputs["attention", str(dtype), groups] = torch.ops.few_rows.attention(q, k, v, visible, 0.125)
        x = (torch.randn(ROWS, 1000, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
        outputs["rms_norm", str(dtype)] = torch.ops.few_rows.rms_norm(x, torch.ones(1000, dtype=dtype), 1e-5)
    return outputs


BUILD = """
import sys, torch
root, march, portable, out = sys.argv[1:]
sys.path[:0] = [root, root + "/tests"]
from cpu import kernels
kernels.build(march, portable=portable == "portable")
assert kernels.load()
for path in torch.ops.few_rows.paths():  # what the report says this build multiplies with
    print(path)
if out != "-":
    from test_cpu import kernel_outputs
    torch.save(kernel_outputs(), out)
"""


def build_in(tmp_path, march, portable=False, out="-", **kwargs):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    return [sys.executable, "-c", BUILD, str(ROOT), march, "portable" if portable else "", str(out)], env


def test_the_portable_build_gives_the_native_build_bits(tmp_path):
    """few_rows.cpp built for this CPU without intrinsics (-DFEW_ROWS_PORTABLE: its plain code, the same lanes, sums
    and trees, and the layouts a CPU without AVX-512 gets) gives every kernel's outputs of the build for this CPU bit
    for bit: every routine written with intrinsics against the scalar reference beside it (few_rows/*.h, named
    <routine>_reference)."""
    assert kernels.load()
    out = tmp_path / "portable.pt"
    command, env = build_in(tmp_path, "native", portable=True, out=out)
    built = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=900)
    # what its report would say: no intrinsics
    assert built.stdout.splitlines() == ["dense rows, 8-lane vectors", "bf16 tiles, plain code", "int8 tiles, plain code",
                                         "int4 tiles, plain code", "6-bit tiles, plain code", "6-bit codes, plain code",
                                         "int4k tiles, plain code"]
    portable, native = torch.load(out), kernel_outputs()
    assert len(set(portable) & set(native)) >= 0.8 * len(native)
    different = [case for case, y in native.items() if case in portable and not torch.equal(portable[case], y)]
    assert not different, different


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs an x86 CPU with AVX2")
def test_the_avx2_build_gives_the_native_build_bits(tmp_path):
    """few_rows.cpp built for AVX2 (16-lane sums in two 256-bit vectors, its own tile shapes, integer tiles with
    vpmaddubsw and vpmaddwd where this CPU has vpdpbusd and vpdpwssd) gives the build for this CPU's bits, so on an
    AVX-512 machine its AVX2 code is exercised too. Built in an empty cache, it says so in one line with the time it
    took; loaded again, it says nothing."""
    assert kernels.load()
    out = tmp_path / "avx2.pt"
    command, env = build_in(tmp_path, "haswell", out=out)
    first = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=900)
    assert re.fullmatch(r"building few_rows.cpp for this CPU \(-march=haswell; once per source, flags, torch and "
                        r"CPU\)\.\.\. done in \d+ s: .*\.so\n", first.stderr), first.stderr
    again = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=900)
    assert again.stderr == ""
    paths = first.stdout.splitlines()
    assert paths[1:4] + paths[6:] == ["bf16 tiles, fused multiply-adds (AVX2)", "int8 tiles, vpmaddwd (AVX2)",
                                      "int4 tiles, vpmaddubsw (AVX2)", "int4k tiles, vpmaddubsw (AVX2)"], first.stdout
    avx2, native = torch.load(out), kernel_outputs()
    assert len(set(avx2) & set(native)) >= 0.8 * len(native)
    different = [case for case, y in native.items() if case in avx2 and not torch.equal(avx2[case], y)]
    assert not different, different


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64")
def test_a_killed_build_blocks_nothing_and_a_waiting_one_says_for_whom(tmp_path):
    """A build killed midway (SIGKILL, as a test's timeout or a closed terminal does) leaves no lock behind: the
    next run builds at once. A run that finds another process building says whose build it waits for."""
    import fcntl
    root = tmp_path / "extensions"
    command, env = build_in(tmp_path, "x86-64")
    killed = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL, start_new_session=True)
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
        second = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        waiting = read_line(second.stderr, timeout=300)  # however long a busy machine takes to import torch
        fcntl.flock(held, fcntl.LOCK_UN)
    _, rest = second.communicate(timeout=900)
    stderr = waiting + rest
    assert second.returncode == 0, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(f"waiting for process 4242's build of few_rows.cpp (lock {lock}"), stderr
    assert lines[1].startswith("building few_rows.cpp for this CPU (-march=x86-64;") and " done in " in lines[1]
    assert not list(root.glob("*.build-*")), "the killed build's directory was not cleaned up"


def test_kernel_builds_are_keyed_by_their_source():
    """A build is named by a hash of what made it (source, flags, torch, this CPU's features): two checkouts or
    versions never load or rebuild each other's."""
    source = kernels.source_text()
    name = kernels.build_name(source, "native")
    assert name.startswith("few_rows_") and name == kernels.build_name(source, "native")
    assert name != kernels.build_name(source + "\n// an edit", "native")
    assert name != kernels.build_name(source, "haswell")


# ---------------------------------------------------------------- the backend around model.py

def test_the_backend_serves_every_product_and_op_and_says_what(smollm2, capsys):
    """SmolLM2 in bf16: every product replaced (by assignment) with a few_rows Linear, model.py's rms_norm and attention
    served, nothing refused and nothing said; its weights counted once (the tied head's tiles and the embedding)."""
    ckpt, _ = smollm2
    m = load_model(ckpt, "cpu", torch.bfloat16)
    report = backend.report(m)
    assert report.name == "cpu" and report.fallback is None, report
    bf16_tiles = torch.ops.few_rows.paths()[1]  # how this build multiplies its bf16 tiles (linear.h's Layout order)
    assert report.serves == (f"few_rows.cpp: 121 products (121 plain in {bf16_tiles}), rms_norm and attention; "
                             f"{cpu.amx_note()}"), report.serves
    assert bf16_tiles.startswith("bf16 tiles, ") and len(torch.ops.few_rows.paths()) == 7
    assert all(type(layer.attention.wqkv) is cpu.Linear and type(layer.feed_forward.w2) is cpu.Linear
               for layer in m.layers) and type(m.output) is cpu.Linear
    assert {"rms_norm", "attention"} <= cpu.served_ops
    assert capsys.readouterr().err == ""
    head = m.output.weight.numel() * 2
    assert report.step_bytes == sum(t.numel() * t.element_size() for t in backend.weights(m).values()) \
        - m.tok_embeddings.weight.numel() * 2
    assert report.step_bytes > 0.99 * 134.5e6 * 2 - head


def test_a_format_whose_reference_a_fork_edits_runs_the_fork_s_code(tiny, monkeypatch, capsys):
    """A fork that edits a format's reference forward in quantize.py (int8 here, as a fork trying another rounding of
    the activations would) gets its own math for those products, with one line saying why: the spot check finds the
    kernel no longer computes the reference. The other kernels still serve (model.py's ops, every other format)."""
    ckpt, _ = tiny("llama_gqa_tied")
    capsys.readouterr()
    shipped = quantize.Int8Linear.forward

    def fork(self, x):
        return shipped(self, x) * 1.25
    monkeypatch.setattr(quantize.Int8Linear, "forward", fork)
    monkeypatch.setattr(cpu, "checks", {})  # the process's verdicts were the shipped code's
    m = quantize.quantize_model(load_model(ckpt, "cpu", torch.float32, backend="torch"), "int8")
    report = cpu.apply(m)
    err = capsys.readouterr().err
    assert re.fullmatch(r"warning: CPU backend: int8 products: it differs from its reference by 0\.2 \(bound 0\.01\); "
                        r"int8 products run model.py's reference\n", err), err
    assert report.name == "cpu" and "int8 products" in report.fallback
    assert all(type(layer.attention.wqkv) is quantize.Int8Linear for layer in m.layers)
    assert {"rms_norm", "attention"} <= cpu.served_ops


def test_fp16_is_refused_in_one_line(tiny, capsys):
    ckpt, _ = tiny("llama_gqa_tied")
    capsys.readouterr()
    m = load_model(ckpt, "cpu", torch.float16)
    assert backend.report(m).name == "torch"
    assert capsys.readouterr().err.startswith("warning: CPU backend: none of its kernels takes fp16")
    assert not any(type(x) is cpu.Linear for x in m.modules())


def test_a_step_gives_the_same_bits_on_any_number_of_threads(smollm2):
    """Decoding may drop a thread while another process keeps a core busy (decoding's ThreadSizer): every output of a
    kernel is summed by one thread, and the compiled glue between them is elementwise, so 1 and 2 threads give the
    same logits, bit for bit, eager and compiled."""
    ckpt, _ = smollm2
    m = load_model(ckpt, "cpu", torch.bfloat16)
    m.setup_caches(1, 256)
    most = torch.get_num_threads()
    step = torch.compile(m, fullgraph=True)
    results = {}
    try:
        with torch.no_grad():
            m(torch.arange(100, 140)[None], torch.arange(40)[None], torch.tensor([[39]]))
            for threads in (1, max(most, 2)):
                torch.set_num_threads(threads)
                for name, run in (("eager", m), ("compiled", step)):
                    results[name, threads] = run(torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(40, 45)[None])
    finally:
        torch.set_num_threads(most)
    assert torch.equal(results["eager", 1], results["eager", max(most, 2)])
    assert torch.equal(results["compiled", 1], results["compiled", max(most, 2)])


# ---------------------------------------------------------------- forks: model.py edited, compiled, exact

def fork_rms_norm(self, x):
    return torch.ops.fastdecode.rms_norm(x, self.weight, self.eps * 1e4)  # eps changed


def fork_activation(self, x):
    gate, up = self.w13(x).chunk(2, -1)
    return self.w2(F.gelu(gate, approximate="tanh") * up)  # SiLU -> GELU


def fork_attend(self, q, k, v, visible):
    return torch.ops.fastdecode.attention(q, k, v, visible, 0.9 * q.shape[-1] ** -0.5)  # attention's scale


shipped_rotary = model.apply_rotary


def fork_rotary(x, cos, sin, rotary_dim):
    return shipped_rotary(x, cos, -sin, rotary_dim)  # rotating the other way


FORKS = {"rms_norm": (model.RMSNorm, "forward", fork_rms_norm),
         "activation": (model.FeedForward, "forward", fork_activation),
         "rotary": (model, "apply_rotary", fork_rotary),
         "attention scale": (model.Attention, "attend", fork_attend)}


@pytest.mark.parametrize("fork", FORKS)
def test_a_fork_runs_compiled_around_the_kernels_takes_effect_and_stays_exact(smollm2, monkeypatch, capsys, fork):
    """model.py edited as a forker would (RMSNorm's eps, the MLP's activation, rotary, attention's scale): nothing is
    detected or routed around, the backend serves every product and op as for the shipped model, and says nothing.
    In float32 the compiled fork's 24 greedy tokens are --backend torch's (model.py's references, eager), and not the
    shipped model's (the edit takes effect); in bf16, speculation (n-gram drafts, K = 4) and the compiled verify give
    the fork's plain tokens."""
    ckpt, _ = smollm2
    owner, name, function = FORKS[fork]
    prompt = Tokenizer(ckpt).encode("def fibonacci(n):")
    shipped = generate(load_model(ckpt, "cpu", torch.float32), [prompt], 24, Steps())[0][0]
    monkeypatch.setattr(owner, name, function)
    torch._dynamo.reset()  # compiled steps of the model as it was: Dynamo does not guard on a class's methods
    capsys.readouterr()
    forked = load_model(ckpt, "cpu", torch.float32)
    assert capsys.readouterr().err == "" and backend.report(forked).fallback is None
    compiled = generate(forked, [prompt], 24, Steps(compile=True))[0][0]
    with cpu.references():
        reference = generate(load_model(ckpt, "cpu", torch.float32, backend="torch"), [prompt], 24, Steps())[0][0]
    assert compiled == reference
    assert compiled != shipped
    bf16 = load_model(ckpt, "cpu", torch.bfloat16)
    steps = Steps(compile=True)
    plain = generate(bf16, [prompt], 48, steps)[0][0]
    spec = generate(bf16, [prompt], 48, steps, drafter=NgramDrafter(), speculate_k=4)[0][0]
    assert spec == plain
    torch._dynamo.reset()


shipped_visible_slots = model.visible_slots


def fork_window(slots, n_slots):
    seen = shipped_visible_slots(slots, n_slots)
    return seen & (torch.arange(n_slots, device=slots.device) > slots[..., None] - 16)  # the last 16 slots


def fork_sinks(slots, n_slots):
    s = torch.arange(n_slots, device=slots.device)  # the first 4 slots and the last 12
    return shipped_visible_slots(slots, n_slots) & ((s < 4) | (s > slots[..., None] - 12))


def fork_prefix(slots, n_slots):
    return shipped_visible_slots(slots, n_slots) | (torch.arange(n_slots, device=slots.device) < 8)  # prefix LM


VISIBILITY_FORKS = {"sliding window": fork_window, "attention sinks": fork_sinks, "prefix mask": fork_prefix}
LONG_PROMPT = ("def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one "
               "sorted list, keeping duplicates, in linear time.\"\"\"\n")


@pytest.mark.parametrize("fork", VISIBILITY_FORKS)
def test_a_fork_s_visibility_is_honored_by_every_path(smollm2, monkeypatch, capsys, fork):
    """What a row sees edited into model.py's glue (a window, sinks, a prefix every row sees), over a prompt longer
    than the window: served by the CPU kernels with no word on stderr, eager and compiled, its 24 greedy tokens in
    float32 are --backend torch's and not the shipped model's; in bf16 (eager: the compiled verify's exactness is the
    other forks' test), n-gram and draft-model speculation (K = 4) give its plain tokens."""
    ckpt, _ = smollm2
    prompt = Tokenizer(ckpt).encode(LONG_PROMPT)
    assert len(prompt) > 30
    shipped = generate(load_model(ckpt, "cpu", torch.float32), [prompt], 24, Steps())[0][0]
    monkeypatch.setattr(model, "visible_slots", VISIBILITY_FORKS[fork])
    torch._dynamo.reset()
    capsys.readouterr()
    forked = load_model(ckpt, "cpu", torch.float32)
    assert capsys.readouterr().err == "" and backend.report(forked).fallback is None
    assert {"rms_norm", "attention"} <= cpu.served_ops
    eager = generate(forked, [prompt], 24, Steps())[0][0]
    compiled = generate(forked, [prompt], 24, Steps(compile=True))[0][0]
    with cpu.references():
        reference = generate(load_model(ckpt, "cpu", torch.float32, backend="torch"), [prompt], 24, Steps())[0][0]
    assert eager == compiled == reference
    assert reference != shipped
    bf16 = load_model(ckpt, "cpu", torch.bfloat16)
    plain = generate(bf16, [prompt], 32, Steps())[0][0]
    ngram = generate(bf16, [prompt], 32, Steps(), drafter=NgramDrafter(), speculate_k=4)[0][0]
    drafted = generate(bf16, [prompt], 32, Steps(), drafter=ModelDrafter(load_model(ckpt, "cpu", torch.bfloat16)),
                       speculate_k=4)[0][0]
    assert ngram == plain and drafted == plain
    torch._dynamo.reset()


def test_sliding_window_layers_are_served_compiled_and_exact(tiny):
    """The tiny Gemma 3, two of its three layers seeing windows of 8 slots with their own rotary base, over a 40-token
    prompt: served by the CPU kernels, eager and compiled, its 24 greedy tokens in float32 are --backend torch's; in
    bf16, compiled, self-drafted speculation (K = 4 and auto) gives its plain tokens. (Mistral's window is the same
    mask: test_model.py holds it to transformers.)"""
    ckpt, _ = tiny("gemma3_sliding")
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with cpu.references():
        reference = generate(load_model(ckpt, "cpu", torch.float32, backend="torch"), [prompt], 24, Steps())[0][0]
    torch._dynamo.reset()
    served = load_model(ckpt, "cpu", torch.float32)
    assert backend.report(served).fallback is None and {"rms_norm", "attention"} <= cpu.served_ops
    assert generate(served, [prompt], 24, Steps())[0][0] == reference
    assert generate(served, [prompt], 24, Steps(compile=True))[0][0] == reference
    bf16, steps = load_model(ckpt, "cpu", torch.bfloat16), Steps(compile=True)
    plain = generate(bf16, [prompt], 32, steps)[0][0]
    drafter = ModelDrafter(load_model(ckpt, "cpu", torch.bfloat16), compile=True)
    for k in (4, "auto"):
        assert generate(bf16, [prompt], 32, steps, drafter=drafter, speculate_k=k)[0][0] == plain, k
    torch._dynamo.reset()


def test_the_load_time_check_refuses_an_op_one_step_off_or_raising_in_one_line(smollm2, monkeypatch, capsys):
    """model.py's rms_norm edited so that one output is one bf16 step from the kernel's: refused (the kernel is built
    to be exact), in one line, and the op runs its reference; a reference whose signature a fork changed (TypeError)
    and a kernel that raises anything are refused likewise, and the model still loads."""
    ckpt, _ = smollm2
    shipped = model.rms_norm

    def one_step_off(x, weight, eps):
        y = shipped(x, weight, eps)
        y.view(torch.int16).view(-1)[7] += 1  # one output one step up
        return y

    def no_eps(x, weight):  # a fork's changed signature
        return shipped(x, weight, 1e-5)

    def raising(*args):
        raise ValueError("a kernel's bug")
    cases = {"one step off": (model, "rms_norm", one_step_off, "rms_norm", "differ from model.py's rms_norm"),
             "signature": (model, "rms_norm", no_eps, "rms_norm", "TypeError"),
             "raises": (torch.ops.few_rows, "attention", raising, "attention", "ValueError: a kernel's bug")}
    for case, (owner, name, function, op, why) in cases.items():
        with monkeypatch.context() as patch:
            patch.setattr(cpu, "checks", {})
            patch.setattr(owner, name, function)
            capsys.readouterr()
            loaded = load_model(ckpt, "cpu", torch.bfloat16)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"model.py's {op}" in err[0] and why in err[0], (case, err)
            assert op not in cpu.served_ops and why in backend.report(loaded).fallback, case
    load_model(ckpt, "cpu", torch.bfloat16)
    assert {"rms_norm", "attention"} <= cpu.served_ops
