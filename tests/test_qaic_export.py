"""scripts/export_qaic.py and scripts/run_onnx.py: the exported graphs under onnxruntime reproduce model.py.

Greedy tokens of the onnxruntime speculative loop (the card's host loop) equal the PyTorch plain greedy tokens
(48 tokens, 2 prompts) for real SmolLM2-135M drafted by itself and by a random-weight model of its vocabulary,
and for a tiny random CodeGen; the graphs' logits match PyTorch within 1e-4 in prefill and decode.
"""
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from safetensors.torch import save_file

import export_qaic
import run_onnx
from bench import humaneval_tasks
from generate import Steps, generate, load_model
from checkpoint import InputError
from model import ModelArgs, Transformer
from tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
K, PREFILL, CTX, NEW = 5, 32, 320, 48
CODEGEN_CTX = 128  # the tiny CodeGen's context is 256
LOGITS_TOL = 1e-4


def export(checkpoint, out: Path, role: str, ctx=CTX) -> Path:
    opts = export_qaic.build_parser().parse_args(
        ["--checkpoint_path", str(checkpoint), "--output_dir", str(out), "--role", role, "--speculate_k", str(K),
         "--ctx_len", str(ctx), "--prefill_len", str(PREFILL)])
    return export_qaic.export(opts)


def random_draft_checkpoint(target_dir: Path, out: Path) -> Path:
    """A 2-layer random-weight Llama with the target's vocabulary and tokenizer."""
    config = json.loads((target_dir / "config.json").read_text())
    args = ModelArgs(vocab_size=config["vocab_size"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     intermediate_size=128, max_seq_len=config["max_seq_len"])
    torch.manual_seed(3)
    model = Transformer(args)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, **dataclasses.asdict(args)}))
    shutil.copy(target_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def smollm2_exports(smollm2, tmp_path_factory):
    ckpt, _ = smollm2
    root = tmp_path_factory.mktemp("qaic_smollm2")
    random_dir = random_draft_checkpoint(ckpt, root / "random_ckpt")
    return dict(ckpt=ckpt, target=export(ckpt, root / "target", "target"), draft=export(ckpt, root / "draft", "draft"),
                random_draft=export(random_dir, root / "random_draft", "draft"))


@pytest.fixture(scope="module")
def codegen_exports(tiny, tmp_path_factory):
    ckpt, _ = tiny("codegen_partial_rotary")
    root = tmp_path_factory.mktemp("qaic_codegen")
    return dict(ckpt=ckpt, target=export(ckpt, root / "target", "target", CODEGEN_CTX),
                draft=export(ckpt, root / "draft", "draft", CODEGEN_CTX))


def plain_greedy(ckpt, prompts):
    model = load_model(ckpt, "cpu", torch.float32)
    return [generate(model, [p], NEW, Steps())[0][0] for p in prompts]


def smollm2_prompts(ckpt):
    tokenizer = Tokenizer(ckpt)
    return [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(2)]


@pytest.mark.parametrize("draft", ["draft", "random_draft"])
def test_smollm2_onnx_speculative_equals_pytorch_greedy(smollm2_exports, draft):
    e = smollm2_exports
    prompts = smollm2_prompts(e["ckpt"])
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e[draft], "draft")
    for prompt, expected in zip(prompts, plain_greedy(e["ckpt"], prompts), strict=True):
        tokens, accepted = run_onnx.speculative_greedy(target, drafter, prompt, NEW)
        assert tokens == expected
        if draft == "draft":
            assert set(accepted) == {K}  # the target drafting for itself: every draft accepted
        else:
            assert accepted[0] >= 0.8 * sum(accepted.values())  # a random draft: almost every round rejects at once


def test_codegen_onnx_speculative_equals_pytorch_greedy(codegen_exports):
    e = codegen_exports
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 40)]  # the second spans two chunks
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e["draft"], "draft")
    for prompt, expected in zip(prompts, plain_greedy(e["ckpt"], prompts), strict=True):
        tokens, accepted = run_onnx.speculative_greedy(target, drafter, prompt, NEW)
        assert tokens == expected and set(accepted) == {K}


@pytest.mark.parametrize("family", ["smollm2", "codegen"])
def test_exported_logits_match_pytorch(family, smollm2_exports, codegen_exports):
    """Prefill in two chunks (the second padded with position -1), then one decode: target logits at every valid
    position, draft logits at the last one, against model.py's forward in fp32."""
    e = smollm2_exports if family == "smollm2" else codegen_exports
    model = load_model(e["ckpt"], "cpu", torch.float32)
    model.setup_caches(1, CODEGEN_CTX)
    tokens = torch.randint(3, model.args.vocab_size, (1, PREFILL + 8 + K + 1), generator=torch.Generator().manual_seed(1))
    prompt, decode = tokens[:, :PREFILL + 8], tokens[:, PREFILL + 8:]
    with torch.no_grad():
        expected = torch.cat([model(prompt, torch.arange(prompt.shape[1])[None]),
                              model(decode, torch.arange(prompt.shape[1], tokens.shape[1])[None])], dim=1)[0].numpy()
    for role in ("target", "draft"):
        graph = run_onnx.ExportedModel(e[role], role)
        chunks = [(prompt[0, :PREFILL], 0), (prompt[0, PREFILL:], PREFILL)]
        if role == "target":
            chunks.append((decode[0], prompt.shape[1]))
        else:
            chunks += [(decode[0, i:i + 1], prompt.shape[1] + i) for i in range(decode.shape[1])]
        for ids, start in chunks:
            logits = graph(ids.tolist(), start)
            want = expected[start:start + len(ids)] if role == "target" else expected[start + len(ids) - 1][None]
            # measured here: max |difference| 5.8e-5 (SmolLM2, logits up to 32); allclose leaves room for other CPUs'
            # kernels, whose fp32 sums round in another order
            np.testing.assert_allclose(logits, want, rtol=LOGITS_TOL, atol=LOGITS_TOL, err_msg=f"{role} at {start}")


def test_graph_and_side_files_agree(smollm2_exports):
    out = smollm2_exports["target"]
    onnx.checker.check_model(str(out / "model.onnx"))
    graph_model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert max(o.version for o in graph_model.opset_import if o.domain in ("", "ai.onnx")) <= 17
    graph = graph_model.graph
    symbols = {d.dim_param for v in [*graph.input, *graph.output] for d in v.type.tensor_type.shape.dim if d.dim_param}
    entries = json.loads((out / "specializations.json").read_text())["specializations"]
    assert [e["seq_len"] for e in entries] == [str(PREFILL), str(K + 1)]
    assert all(set(e) == symbols == {"batch_size", "seq_len", "ctx_len"} for e in entries)
    assert all(isinstance(v, str) for e in entries for v in e.values())
    n_layers = json.loads((out / "config.json").read_text())["n_layers"]
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    assert [i.name for i in graph.input] == ["input_ids", "position_ids", *past]
    assert [o.name for o in graph.output] == ["logits", *(f"{p}_RetainedState" for p in past)]
    custom_io = yaml.safe_load((out / "custom_io.yaml").read_text())
    assert {entry["IOName"] for entry in custom_io} == {*past, *(f"{p}_RetainedState" for p in past)}
    assert {entry["Precision"] for entry in custom_io} == {"float16"}
    # each retained state is its past input updated by one ScatterND: the cache never grows by concatenation
    producers = {out_name: node for node in graph.node for out_name in node.output}
    for name in past:
        node = producers[f"{name}_RetainedState"]
        assert node.op_type == "ScatterND" and node.input[0] == name
    big = [t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.data_location == 0
           and np.abs(onnx.numpy_helper.to_array(t)).max(initial=0) > np.finfo(np.float16).max]
    assert not big
    tokenizer = Tokenizer(out)  # self-contained: the runtime reads config and tokenizer from the export
    assert tokenizer.vocab_size == json.loads((out / "qaic.json").read_text())["vocab_size"]


def test_run_onnx_cli(codegen_exports, tmp_path):
    e = codegen_exports
    result = subprocess.run([sys.executable, "scripts/run_onnx.py", "--target", e["target"], "--draft", e["draft"],
                             "--prompt", "def add(a, b):", "--max_new_tokens", "16", "--json"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout)
    prompt = Tokenizer(e["ckpt"]).encode("def add(a, b):")
    assert line["tokens"] == generate(load_model(e["ckpt"], "cpu", torch.float32), [prompt], 16, Steps())[0][0]
    assert line["mean_accepted"] == K + 1 and {"accept_counts", "speculate_k", "tokens_per_s", "text"} <= set(line)


def test_bad_input_gives_one_line_errors(codegen_exports, tmp_path):
    e = codegen_exports
    result = subprocess.run([sys.executable, "scripts/export_qaic.py", "--checkpoint_path", e["ckpt"], "--output_dir",
                             tmp_path / "x", "--speculate_k", "32", "--prefill_len", "32"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0 and not (tmp_path / "x").exists()
    assert result.stderr.strip().splitlines() == [
        "error: --speculate_k 32 needs a decode of 33 positions, longer than --prefill_len 32; raise --prefill_len "
        "or lower --speculate_k"]
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e["draft"], "draft")
    with pytest.raises(InputError, match=rf"ctx_len {CODEGEN_CTX} is smaller than prompt \(120\) \+ max_new_tokens "
                                         rf"\(20\) \+ speculate_k \({K}\) - 1 = 144; re-export with --ctx_len 144 or more"):
        run_onnx.speculative_greedy(target, drafter, [5] * 120, 20)
    with pytest.raises(InputError, match="role is 'draft', expected 'target'"):
        run_onnx.ExportedModel(e["draft"], "target")
    with pytest.raises(InputError, match="a quantize.py checkpoint; export the float model.safetensors"):
        import quantize
        export_qaic.load_float_model(quantize.quantize_checkpoint(e["ckpt"], "int8", progress=False), CODEGEN_CTX)


def test_padding_positions_write_nothing(codegen_exports):
    graph = run_onnx.ExportedModel(codegen_exports["target"], "target")
    rng = np.random.default_rng(0)
    graph.past = {name: rng.standard_normal(v.shape).astype(np.float32) for name, v in graph.past.items()}
    before = dict(graph.past)
    logits = graph([5, 6, 7], 10)  # 3 tokens at positions 10..12, padded to the decode length with position -1
    assert np.isfinite(logits).all()
    for name, old in before.items():
        new = graph.past[name]
        assert not np.array_equal(new[:, :, 10:13], old[:, :, 10:13])
        changed = np.ones(old.shape[2], bool)
        changed[10:13] = False
        assert np.array_equal(new[:, :, changed], old[:, :, changed]), name  # the last slot included
