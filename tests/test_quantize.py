"""quantize.py: file sizes, loading, greedy parity with the dequantize-then-run reference, quantized self-draft."""
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import backend
import mx
import quantize
from cli import humaneval_tasks
from conftest import ROOT
from cpu import kernels
from checkpoint import map_safetensors
from decoding import Steps, generate
from loading import load_model
from speculative import ModelDrafter, NgramDrafter
from test_generate import assert_interrupted, assert_one_line_error, cli, interrupted
from tokenizer import Tokenizer

# Linear bits per weight on disk (codes + scales), from the acceptance list
MAX_BITS = {"int8": 8.3, "int4": 5.0, "int4k": 4.85, "mxfp8": 8.25, "mxfp6": 6.25, "mxfp6_e3m2": 6.25, "mxfp4": 4.25,
            "mxint8": 8.25}  # int4k: 4.625 where in_features fill super-blocks of 256 (SmolLM2's 576 pads its last)


def test_file_sizes_and_metadata(quantized):
    for mode, path in quantized.items():
        tensors, metadata = map_safetensors(path)
        assert metadata["quantization"] == mode
        linear_bytes = linear_weights = 0
        for name, t in tensors.items():
            if name.endswith((".scales", ".scales_and_zeros", ".factors")) or (name.endswith(".weight") and not t.is_floating_point()):
                linear_bytes += t.numel() * t.element_size()
            if name.endswith(".weight") and not t.is_floating_point():
                linear_weights += t.shape[0] * {"int4": 2, "int4k": 2, "mxfp6": 4 / 3, "mxfp6_e3m2": 4 / 3, "mxfp4": 2}.get(mode, 1) * t.shape[1]
        bits = 8 * linear_bytes / linear_weights
        assert bits <= MAX_BITS[mode], (mode, bits)
        assert "output.weight" in tensors and not tensors["output.weight"].is_floating_point()  # the head too


class RoundedInputsLinear(nn.Linear):
    """int4's arithmetic: inputs rounded to 8 bits per block of 32 (quantize.round_activations)."""

    def forward(self, x):
        return super().forward(quantize.round_activations(x))


def reference_model(path, dtype):
    """The same file, dequantized up front with the plain formulas (mx: the code table), into nn.Linear."""
    mode = map_safetensors(path)[1]["quantization"]
    model = load_model(path, "cpu", dtype, backend="torch")
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, quantize.MODULES):
                continue
            if mode == "int8":
                w = child.weight.float() * child.scales.float()[:, None]
            elif mode in ("int4", "int4k"):
                w = child.dequantize()
            else:
                w = mx.dequantize(mx.unpack(child.weight, child.fmt.bits), child.scales, child.fmt)
            linear = (RoundedInputsLinear if mode in ("int4", "int4k") else nn.Linear)(w.shape[1], w.shape[0],
                                                                            bias=child.bias is not None, dtype=dtype)
            linear.weight.data = w.to(dtype)
            if child.bias is not None:
                linear.bias.data = child.bias.data
            setattr(module, child_name, linear)
    return model


@pytest.fixture(scope="module")
def prompts(smollm2):
    tokenizer = Tokenizer(smollm2[0])
    return [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(2)]


@pytest.mark.parametrize("mode", quantize.MODES)
def test_quantized_greedy_equals_dequantized_reference(quantized, prompts, mode):
    """Compiled decode through the fused / packed kernels (and eager prefill through the packed kernels or a
    per-layer decode) vs eager F.linear on weights dequantized up front from the file with the plain formulas:
    the same math on different paths, fp32 activations, 16 greedy tokens on 2 HumanEval prompts.

    int4 and int4k round their inputs to 8 bits (quantize.round_activations), and then two paths cannot agree bit for bit
    for long: a float difference far below a rounding step moves some input across a rounding boundary now and
    then, and 30 layers carry it on (one ulp of an input embedding moves SmolLM2's int4 logits by up to 0.42,
    its int8 logits by 1e-5). So int4's tokens are checked against the reference's logits at the same places
    (the whole output as one reference prefill): each is the reference's top token or within 0.5 of it, and
    most are its top token. Measured over 6 prompts x 32 tokens: 96% top, the others within 0.15 (near-ties)."""
    torch._dynamo.reset()
    model = load_model(quantized[mode], "cpu", torch.float32)
    assert backend.report(model).name == "cpu" and backend.report(model).fallback is None
    reference = reference_model(quantized[mode], torch.float32)
    steps = Steps(compile=True)
    agree = 0
    for prompt in prompts:
        ours, _ = generate(model, [prompt], 16, steps)
        if mode not in ("int4", "int4k"):
            ref, _ = generate(reference, [prompt], 16, Steps())
            assert ours == ref, mode
            continue
        tokens = torch.tensor([prompt + ours[0]])
        reference.setup_caches(1, tokens.shape[1])
        with torch.no_grad():
            logits = reference(tokens, torch.arange(tokens.shape[1])[None])[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(-1, torch.tensor(ours[0])[:, None])[:, 0]
        assert (logits.max(-1).values - chosen < 0.5).all(), (logits.max(-1).values - chosen).max()
        agree += (logits.argmax(-1) == torch.tensor(ours[0])).sum().item()
    assert mode not in ("int4", "int4k") or agree >= 0.8 * 16 * len(prompts), agree


def test_quantized_self_draft_is_lossless(smollm2, quantized, prompts):
    """The bf16 model, compiled, with its own int4 and mxfp4 files as drafts emits exactly its plain greedy
    tokens: the verify step's logits equal the decode step's bit for bit (every reduction in a kernel, the compiled
    glue elementwise, emulate_precision_casts in decoding.step), so speculation cannot change a near-tie."""
    torch._dynamo.reset()
    ckpt, _ = smollm2
    target = load_model(ckpt, "cpu", torch.bfloat16)
    steps = Steps(compile=True)
    plain = [generate(target, [prompt], 32, steps)[0] for prompt in prompts]
    for mode in ("int4", "mxfp4"):
        drafter = ModelDrafter(load_model(quantized[mode], "cpu", torch.bfloat16), compile=True)
        for prompt, expected in zip(prompts, plain):
            spec, stats = generate(target, [prompt], 32, steps, drafter=drafter, speculate_k=4)
            assert spec == expected, mode
            assert stats["alpha"] > 0.3  # a quantized copy agrees with the target most of the time


@pytest.mark.parametrize("mode", ["bf16", "int4", "int4k", "int8", "mxfp6"])
def test_compiled_speculation_is_exact_at_every_k(smollm2, quantized, prompts, mode):
    """SmolLM2 as a compiled target, bf16 and in int4, int4k, int8 and mxfp6: speculation (n-gram drafts, whose verifies
    check the target's rows, not a draft's quality) gives the target's own plain greedy tokens at K = 1-8 and 16, a
    prompt alone and a batch of 2 (the verify compiled static at the first K, for any K from the second)."""
    torch._dynamo.reset()
    target = load_model(smollm2[0] if mode == "bf16" else quantized[mode], "cpu", torch.bfloat16)
    steps = Steps(compile=True)
    # a prompt's rows times plain weights take PyTorch's GEMM, whose sums may round otherwise at another row count:
    # the batch's plain output is the batch's reference, the prompt's alone its own
    plain = {1: generate(target, prompts[:1], 40, steps)[0], 2: generate(target, prompts, 40, steps)[0]}
    for k in (1, 2, 3, 4, 5, 6, 7, 8, 16):
        batch = prompts if k in (4, 16) else prompts[:1]
        assert generate(target, batch, 40, steps, drafter=NgramDrafter(), speculate_k=k)[0] == plain[len(batch)], k
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["int4", "int8", "mxfp6"])
def test_compiled_speculation_on_amx_tiles_is_exact_at_every_k(smollm2, quantized, prompts, mode):
    """As above with the verifies' and prompts' integer products on AMX tiles (few_rows.amx: the CPU's where it has
    them, else their plain-code emulation) and the decodes on VNNI: the target's plain greedy tokens at K = 1-8 and 16."""
    assert kernels.load()
    if not re.search(r"avx512_?vnni", kernels.cpu_features()):
        pytest.skip("tiles are emulated in builds with AVX512_VNNI only")
    torch._dynamo.reset()
    target = load_model(quantized[mode], "cpu", torch.bfloat16)
    steps = Steps(compile=True)
    plain = generate(target, prompts[:1], 40, steps)[0]
    served = torch.ops.few_rows.amx("")
    torch.ops.few_rows.amx("auto" if served.startswith("AMX tiles serve") else "emulated")
    try:
        for k in (1, 2, 3, 4, 5, 6, 7, 8, 16):
            assert generate(target, prompts[:1], 40, steps, drafter=NgramDrafter(), speculate_k=k)[0] == plain, k
    finally:
        torch.ops.few_rows.amx("auto")
        torch._dynamo.reset()


# Loads one file in a fresh process and prints the peak resident memory of the load and the bytes a decode step
# reads. The baseline is taken after PyTorch's lazy imports for the meta device (~70 MiB of Python modules at its
# first use, whatever the model) and a first GEMM (its code pages, ~10-40 MB), so the peak is what the weights cost.
LOAD_PEAK = """
import sys, torch
sys.path.insert(0, sys.argv[2])
import backend, loading, model
from cpu import kernels
def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
kernels.load()
with torch.device("meta"):
    model.Transformer(model.ModelArgs(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=2, intermediate_size=64))
for dtype in (torch.bfloat16, torch.float32):  # the GEMM code the spot checks' references run
    torch.nn.functional.linear(torch.ones(24, 576, dtype=dtype), torch.ones(4096, 576, dtype=dtype))
base = kib("VmRSS")
loaded = loading.load_model(sys.argv[1], "cpu", torch.bfloat16)
print((kib("VmHWM") - base) * 1024, backend.report(loaded).step_bytes)
"""


def test_loading_peak_stays_within_the_file_and_runtime_buffers(quantized):
    """Peak memory while loading <= 1.2 x the file + the runtime buffers (the bytes a decode step reads: the
    mapped codes for int8, the expanded layouts for int4 and MX). No mode may hold the weights twice."""
    for mode, path in quantized.items():
        result = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(path), str(ROOT)], capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        peak, runtime = map(int, result.stdout.split())
        budget = 1.2 * path.stat().st_size + runtime
        assert peak <= budget, f"{mode}: peak {peak / 1e6:.1f} MB > budget {budget / 1e6:.1f} MB"


def test_a_bf16_model_from_a_float32_file_holds_its_weights_once(smollm2):
    """SmolLM2's demo file is float32: its bf16 weights are made on the heap, and a served product's column tiles are
    then their only copy. Resident after loading <= 1.5 x the bytes a step reads (269 MB; also held: the tied
    head's weight, which the embedding reads, 57 MB). With the tiles beside the weights: 586 MB."""
    ckpt, _ = smollm2
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert f.get_slice("output.weight" if "output.weight" in f.keys() else "tok_embeddings.weight").get_dtype() == "F32"
    result = subprocess.run([sys.executable, "-c", LOAD_PEAK.replace("VmHWM", "VmRSS"), str(ckpt), str(ROOT)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    resident, step = map(int, result.stdout.split())
    assert resident <= 1.5 * step, f"resident {resident / 1e6:.1f} MB, a step reads {step / 1e6:.1f} MB"


# Loads one file in a fresh process; prints how much of the mapped file stays resident after loading, and the
# process's transparent huge pages.
HUGE_PAGES = """
import sys, torch
sys.path.insert(0, sys.argv[2])
import loading
def kib(key, path="/proc/self/status"):
    return next(int(line.split()[1]) for line in open(path) if line.startswith(key))
def file_resident(path):  # KiB of this file's pages mapped in the process
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and " " in line:
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total
loaded = loading.load_model(sys.argv[1], "cpu", torch.bfloat16)
print(file_resident(sys.argv[1]) * 1024, kib("AnonHugePages:", "/proc/self/smaps_rollup") * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and /proc are Linux's")
def test_streamed_weights_move_to_huge_pages_and_leave_the_file(quantized):
    """After loading int8 (whose codes a step would otherwise read from the mapped file), the copied file pages
    are no longer resident in the process (< 10% of the file: the embedding is mapped but unread), and where the
    kernel offers transparent huge pages they hold nearly all of the 135 MB a step reads."""
    path = quantized["int8"]
    result = subprocess.run([sys.executable, "-c", HUGE_PAGES, str(path), str(ROOT)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    file_resident, huge = map(int, result.stdout.split())
    assert file_resident < 0.1 * path.stat().st_size, file_resident
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in thp:
        assert huge >= 120 << 20, huge  # 135 MB of int8 layouts and factors, back to back in 2 MiB pages


def test_cli_loads_a_quantized_file_and_drafts_with_one(quantized):
    path = quantized["int8"]
    result = cli("--checkpoint_path", str(path), "--prompt", "def add(a, b):", "--max_new_tokens", "8", "--json",
                 "--draft_checkpoint", str(quantized["int4"]), "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.splitlines()[-1])["tokens"]) == 8


def test_bad_mode_groupsize_and_shapes(smollm2, tmp_path):
    ckpt, _ = smollm2
    for flags, message in ((["--mode", "int3"], "unsupported --mode 'int3'"),
                           (["--mode", "int4", "--groupsize", "48"], "--groupsize 48 is not supported"),
                           (["--mode", "mxfp6", "--groupsize", "64"], "--groupsize applies to int4 only")):
        result = cli("--checkpoint_path", str(ckpt), *flags, script="quantize.py")
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    with pytest.raises(quantize.InputError, match="layers.0.wq: in_features 48 .* multiple of 32"):
        quantize.quantized_linear("mxfp6", nn.Linear(48, 16), name="layers.0.wq")
    with pytest.raises(quantize.InputError, match="out_features of 16"):
        quantize.quantized_linear("int4", nn.Linear(64, 24), name="output")


def test_ctrl_c_while_quantizing_writes_nothing(smollm2, tmp_path):
    """Ctrl-C in the middle of quantizing: one line, exit status 130, and neither the output nor a temporary file."""
    ckpt, _ = smollm2
    output = tmp_path / "model.mxfp6.safetensors"
    status, _, err = interrupted(["--checkpoint_path", ckpt, "--mode", "mxfp6", "--output", output], "quantize.py",
                                 "quantize mxfp6:")
    assert_interrupted(status, err)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_groupsize_in_the_metadata_is_one_line(quantized, tmp_path):
    """An int4 file whose metadata names a group size quantize.py never writes: one line naming the file."""
    from safetensors.torch import save_file
    tensors, metadata = map_safetensors(quantized["int4"])
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(quantized["int4"].parent / name)
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "model.int4.safetensors",
              metadata=dict(metadata, groupsize="abc"))
    assert_one_line_error(cli("--checkpoint_path", str(tmp_path / "model.int4.safetensors")), "groupsize 'abc'",
                          "re-run quantize.py")


def test_mx_quantizes_in_row_chunks_to_the_same_codes():
    """MXLinear.quantize works through a weight a few rows at a time (its peak memory): the codes and scales are the
    whole weight's, in every MX format."""
    torch.manual_seed(0)
    w = torch.randn(300, 64).bfloat16()
    for mode, fmt in quantize.MX_MODES.items():
        whole = quantize.MXLinear.quantize(w, fmt, "rceil", rows=10**6)
        chunked = quantize.MXLinear.quantize(w, fmt, "rceil", rows=7)
        assert all(torch.equal(whole[k], chunked[k]) for k in whole), mode


def test_bytes_per_step_count_what_each_backend_reads(quantized):
    """backend.Report.step_bytes (the GB/s and % of bandwidth of every report): model.py's modules read their file
    layouts; the CPU backend's products their layouts (mxfp4 expanded to a byte a code: more than the file); gpu.py's
    int4 its packed codes and scales (counted as nothing before: int4's GB/s was ~5x low on CUDA). The embedding
    table is not read by a step (one row of it)."""
    import cpu
    import gpu

    def total(tensors):
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

    for mode in ("int8", "int4", "mxfp6", "mxfp4"):
        plain = load_model(quantized[mode], "cpu", torch.bfloat16, backend="torch")
        files = [t for m in plain.modules() if m is not plain.tok_embeddings
                 for t in [*m.parameters(recurse=False), *(b for n, b in m.named_buffers(recurse=False)
                                                            if n in ("weight", "scales", "scales_and_zeros"))]]
        assert backend.report(plain).step_bytes == total(files), mode
        served = load_model(quantized[mode], "cpu", torch.bfloat16)
        reads = []
        for m in served.modules():
            if type(m) is cpu.Linear:
                reads += [t for t in (m.weight, m.factors, m.table, m.bias) if t is not None]
            elif m is not served.tok_embeddings:
                reads += list(m.parameters(recurse=False))
        assert all(type(m) is cpu.Linear for m in (served.output, served.layers[0].attention.wqkv)), mode
        assert backend.report(served).step_bytes == total(reads), mode
        if mode == "mxfp4":  # expanded codes: a byte each, where the file packs two
            assert backend.report(served).step_bytes > 1.5 * backend.report(plain).step_bytes
    # gpu.py's int4 (building one needs CUDA): the same codes and scales, repacked into a buffer named `packed`
    model = load_model(quantized["int4"], "cpu", torch.bfloat16, backend="torch")
    before = backend.step_bytes(model)
    for name, ref in [(n, m) for n, m in model.named_modules() if type(m) is quantize.Int4Linear]:
        fast = gpu.TinyGemmInt4Linear.__new__(gpu.TinyGemmInt4Linear)
        nn.Module.__init__(fast)
        fast.register_buffer("packed", ref.weight.view(torch.int32).clone())  # tinygemm's tiles: the same bytes
        fast.register_buffer("scales_and_zeros", ref.scales_and_zeros.clone())
        fast.bias = ref.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fast)
    assert backend.step_bytes(model) == before


def test_groupsize_and_scale_rule_flags_reach_the_file(tiny, tmp_path):
    """quantize.py --groupsize and --mx_scale_rule: the file holds what quantize_tensor gives for them and its
    metadata says so; a group larger than a layer's inputs is one line naming the layer."""
    ckpt, _ = tiny("llama_gqa_tied")  # in_features 64 and 128
    w = map_safetensors(ckpt / "model.safetensors")[0]["layers.0.attention.wq.weight"]
    for flags, metadata, expected in [
            (["--mode", "int4", "--groupsize", "64"], {"groupsize": "64"}, quantize.quantize_tensor("int4", w, 64, None)),
            (["--mode", "mxfp4", "--mx_scale_rule", "floor"], {"mx_scale_rule": "floor"},
             quantize.quantize_tensor("mxfp4", w, None, "floor"))]:
        out = tmp_path / f"{flags[1]}.safetensors"
        quantize.main(["--checkpoint_path", str(ckpt), *flags, "--output", str(out)])
        tensors, meta = map_safetensors(out)
        assert meta.items() >= metadata.items(), meta
        for key, t in expected.items():
            assert torch.equal(tensors[f"layers.0.attention.wq.{key}"], t), key
    assert not torch.equal(expected["weight"], quantize.quantize_tensor("mxfp4", w, None, "rceil")["weight"])
    with pytest.raises(SystemExit, match=r"^error: layers\.0\.attention\.w.: in_features 64 .* multiple of 128"):
        quantize.main(["--checkpoint_path", str(ckpt), "--mode", "int4", "--groupsize", "128", "--output",
                       str(tmp_path / "g128.safetensors")])
    assert not (tmp_path / "g128.safetensors").exists()
