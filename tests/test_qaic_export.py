"""scripts/export_qaic.py and scripts/run_onnx.py: the exported graphs reproduce model.py, in fp32 under onnxruntime
and in float16 as the card runs them.

fp32 (onnxruntime): greedy tokens of the speculative host loop equal PyTorch's plain greedy tokens (48 tokens,
2 prompts) for real SmolLM2-135M drafted by itself and by a random-weight model of its vocabulary, and for a tiny
random CodeGen; the graphs' logits match PyTorch within 1e-4 in prefill and decode.
float16 (every float tensor and op in float16, onnx's ReferenceEvaluator): greedy tokens equal PyTorch's fp32 ones
for 48 tokens on 2 HumanEval prompts (SmolLM2) and 3 random prompts (CodeGen), and the speculative loop's tokens
equal plain greedy; the same check on a graph with model.py's own norms fails (x^2 overflows float16).
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
from cli import humaneval_tasks
from decoding import Steps, generate
from loading import load_model
from checkpoint import InputError
import model as model_lib
from model import ModelArgs, Transformer
from tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
K, PREFILL, CTX, NEW = 5, 32, 320, 48
CODEGEN_CTX = 128  # the tiny CodeGen's context is 256
LOGITS_TOL = 1e-4


def export(checkpoint, out: Path, role: str, ctx=CTX, **kwargs) -> Path:
    opts = export_qaic.build_parser().parse_args(
        ["--checkpoint_path", str(checkpoint), "--output_dir", str(out), "--role", role, "--speculate_k", str(K),
         "--ctx_len", str(ctx), "--prefill_len", str(PREFILL)])
    return export_qaic.export(opts, **kwargs)


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
    yield dict(ckpt=ckpt, target=export(ckpt, root / "target", "target"), draft=export(ckpt, root / "draft", "draft"),
               random_draft=export(random_dir, root / "random_draft", "draft"))
    shutil.rmtree(root, ignore_errors=True)  # 1.3 GB of graphs, no longer needed


def tiny_exports(tiny, tmp_path_factory, name):
    """A tiny model's target and draft graphs, at CODEGEN_CTX."""
    ckpt, _ = tiny(name)
    root = tmp_path_factory.mktemp(f"qaic_{name}")
    return dict(ckpt=ckpt, target=export(ckpt, root / "target", "target", CODEGEN_CTX),
                draft=export(ckpt, root / "draft", "draft", CODEGEN_CTX))


@pytest.fixture(scope="module")
def codegen_exports(tiny, tmp_path_factory):
    return tiny_exports(tiny, tmp_path_factory, "codegen_partial_rotary")


@pytest.fixture(scope="module")
def gemma3_exports(tiny, tmp_path_factory):
    """The tiny Gemma 3 (sliding layers of a window of 8 slots, norms after each branch)."""
    return tiny_exports(tiny, tmp_path_factory, "gemma3_sliding")


@pytest.fixture(scope="module")
def qwen3_exports(tiny, tmp_path_factory):
    """The tiny Qwen3 (heads of 32 where dim / heads is 16, each head's q and k RMS-normed)."""
    return tiny_exports(tiny, tmp_path_factory, "qwen3_head_dim")


def plain_greedy(ckpt, prompts, new=NEW):
    model = load_model(ckpt, "cpu", torch.float32)
    return [generate(model, [p], new, Steps())[0][0] for p in prompts]


def smollm2_prompts(ckpt, n=2):
    tokenizer = Tokenizer(ckpt)
    return [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(n)]


def codegen_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 40, 23)]  # the second spans two chunks


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
    prompts = codegen_prompts()[:2]
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e["draft"], "draft")
    for prompt, expected in zip(prompts, plain_greedy(e["ckpt"], prompts), strict=True):
        tokens, accepted = run_onnx.speculative_greedy(target, drafter, prompt, NEW)
        assert tokens == expected and set(accepted) == {K}


def test_onnx_generation_ends_at_an_end_of_generation_token(codegen_exports):
    """As generate.py: the first end-of-generation token ends the output (kept), in plain and speculative loops,
    even inside a round's accepted drafts."""
    e = codegen_exports
    prompt = codegen_prompts()[0]
    expected = plain_greedy(e["ckpt"], [prompt])[0]
    end = expected[5]
    cut = expected[:expected.index(end) + 1]
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e["draft"], "draft")
    tokens, _ = run_onnx.speculative_greedy(target, drafter, prompt, NEW, {end})
    assert tokens == cut and run_onnx.greedy(target, prompt, NEW, {end}) == cut


@pytest.mark.parametrize("family", ["smollm2", "codegen", "gemma3", "qwen3"])
def test_exported_logits_match_pytorch(family, request):
    """Prefill in two chunks (the second padded with position -1), then one decode: target logits at every valid
    position, draft logits at the last one, against model.py's forward in fp32 (Gemma 3's sliding layers seeing
    their window of 8 slots)."""
    e = request.getfixturevalue(f"{family}_exports")
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
            end = start + len(ids)  # the target's decode keeps every position, a prefill and the draft the last
            assert len(logits) == (len(ids) if role == "target" and len(ids) == K + 1 else 1)
            want = expected[end - len(logits):end]
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
    assert [(e["seq_len"], e["num_logits_to_keep"]) for e in entries] == [(str(PREFILL), "1"), (str(K + 1), str(K + 1))]
    assert all(set(e) == symbols == {"batch_size", "seq_len", "ctx_len", "num_logits_to_keep"} for e in entries)
    assert all(isinstance(v, str) for e in entries for v in e.values())
    n_layers = json.loads((out / "config.json").read_text())["n_layers"]
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    assert [i.name for i in graph.input] == ["input_ids", "position_ids", "num_logits_to_keep", *past]
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
    assert {p.name for p in out.iterdir()} == {"model.onnx", "model.onnx.data", "specializations.json", "qaic.json",
                                               "custom_io.yaml", "config.json", "tokenizer.json", ".written-by.json"}
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


def test_bad_input_gives_one_line_errors(codegen_exports, smollm2_exports, tmp_path):
    e = codegen_exports
    result = subprocess.run([sys.executable, "scripts/export_qaic.py", "--checkpoint_path", e["ckpt"], "--output_dir",
                             tmp_path / "x", "--speculate_k", "32", "--prefill_len", "32"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0 and not (tmp_path / "x").exists()
    assert result.stderr.strip().splitlines() == [
        "error: --speculate_k 32 needs a decode of 33 positions, longer than --prefill_len 32; raise --prefill_len "
        "or lower --speculate_k"]
    for args, message in ((["--num_cores", "12/8"], "--num_cores 12/8: a Cloud AI 100 has 16 cores; give each graph at "
                                                     "least 1 and the pair at most 16 in all, such as 11/5"),
                          (["--num_cores", "11:5"], "--num_cores '11:5': give the cores of this graph (1-16) or a "
                                                     "TARGET/DRAFT split of one card such as 11/5"),
                          (["--ctx_len", "16"], "--ctx_len 16 is shorter than one prefill chunk (--prefill_len 32); "
                                                "raise --ctx_len or lower --prefill_len")):
        result = subprocess.run([sys.executable, "scripts/export_qaic.py", "--checkpoint_path", e["ckpt"],
                                 "--output_dir", tmp_path / "x", *args], capture_output=True, text=True, cwd=ROOT,
                                timeout=300)
        assert result.returncode != 0 and result.stderr.strip().splitlines() == [f"error: {message}"]
    for args, message in ((["--prompt", "x", "--runtime", "qaic"],
                           "the Cloud AI 100 runtime is not installed (QAicApi_pb2 not found in /opt/qti-aic/dev); run "
                           "on a host with the card's Platform and Apps SDKs, or use --runtime onnxruntime"),
                          (["--prompt", ""], "empty prompt: give at least one token"),
                          (["--prompt", "x", "--max_new_tokens", "0"], "--max_new_tokens 0: must be at least 1")):
        result = subprocess.run([sys.executable, "scripts/run_onnx.py", "--target", e["target"], "--draft", e["draft"],
                                 *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode != 0 and result.stderr.strip().splitlines() == [f"error: {message}"]
    target, drafter = run_onnx.ExportedModel(e["target"], "target"), run_onnx.ExportedModel(e["draft"], "draft")
    with pytest.raises(InputError, match=rf"ctx_len {CODEGEN_CTX} is smaller than prompt \(120\) \+ max_new_tokens "
                                         rf"\(20\) \+ speculate_k \({K}\) - 1 = 144; re-export with --ctx_len 144 or more"):
        run_onnx.speculative_greedy(target, drafter, [5] * 120, 20)
    with pytest.raises(InputError, match="the draft's vocabulary differs from the target's"):
        run_onnx.check_pair(target, run_onnx.ExportedModel(smollm2_exports["draft"], "draft"), 10, 10)
    with pytest.raises(InputError, match="role is 'draft', expected 'target'"):
        run_onnx.ExportedModel(e["draft"], "target")
    with pytest.raises(InputError, match="a quantize.py checkpoint; export the float model.safetensors"):
        import quantize
        export_qaic.load_float_model(quantize.quantize_checkpoint(e["ckpt"], "int8", progress=False), CODEGEN_CTX)


def test_padding_positions_write_nothing(codegen_exports):
    graph = run_onnx.ExportedModel(codegen_exports["target"], "target")
    rng = np.random.default_rng(0)
    state = graph.runtime
    state.past = {name: rng.standard_normal(v.shape).astype(np.float32) for name, v in state.past.items()}
    before = dict(state.past)
    logits = graph([5, 6, 7], 10)  # 3 tokens at positions 10..12, padded to the decode length with position -1
    assert np.isfinite(logits).all()
    for name, old in before.items():
        new = state.past[name]
        assert not np.array_equal(new[:, :, 10:13], old[:, :, 10:13])
        changed = np.ones(old.shape[2], bool)
        changed[10:13] = False
        assert np.array_equal(new[:, :, changed], old[:, :, changed]), name  # the last slot included


def float16_greedy_check(e, prompts):
    """On the float16 runtime, the speculative loop (target and draft in float16) gives PyTorch's fp32 greedy tokens:
    each is the float16 target's argmax in a verify, so its greedy tokens too, which the first prompt checks alone for
    half as many tokens (the emulator takes most of a second a call on SmolLM2)."""
    target = run_onnx.ExportedModel(e["target"], "target", "float16")
    drafter = run_onnx.ExportedModel(e["draft"], "draft", "float16")
    for i, (prompt, want) in enumerate(zip(prompts, plain_greedy(e["ckpt"], prompts), strict=True)):
        if i == 0:
            assert run_onnx.greedy(target, prompt, NEW // 2) == want[:NEW // 2]
        tokens, _ = run_onnx.speculative_greedy(target, drafter, prompt, NEW)  # a new sequence overwrites the state
        assert tokens == want


def test_smollm2_float16_greedy_equals_pytorch_float32(smollm2_exports):
    float16_greedy_check(smollm2_exports, smollm2_prompts(smollm2_exports["ckpt"], 2))


def test_codegen_float16_greedy_equals_pytorch_float32(codegen_exports):
    float16_greedy_check(codegen_exports, codegen_prompts())


def test_float16_check_fails_with_model_py_norms(smollm2, tmp_path, monkeypatch):
    """The check can fail: with model.py's RMSNorm math in the graph (its op's reference, model.rms_norm), x^2 overflows
    float16 (SmolLM2's norm inputs reach |x| = 23,852), the hidden state is zeroed, and the first greedy token is 0 on
    every prompt."""
    ckpt, _ = smollm2

    class ModelPyNorm(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.weight, self.eps = norm.weight, norm.eps

        def forward(self, x):
            return model_lib.rms_norm(x, self.weight, self.eps)
    monkeypatch.setattr(export_qaic, "Float16SafeNorm", ModelPyNorm)
    out = export(ckpt, tmp_path / "target", "target")
    fp32, fp16 = run_onnx.ExportedModel(out, "target", "onnxruntime"), run_onnx.ExportedModel(out, "target", "float16")
    prompts = smollm2_prompts(ckpt, 3)
    for prompt, want in zip(prompts, plain_greedy(ckpt, prompts, 1), strict=True):
        assert int(fp32.prefill(prompt).argmax()) == want[0]
        assert int(fp16.prefill(prompt).argmax()) == 0 != want[0]


def test_ops_are_the_cards(smollm2_exports, codegen_exports):
    """Every op type is in the repository's list of Cloud AI 100 ops (no IsNaN: attention is MatMul, Where,
    Softmax), and ArgMax runs on int32 positions."""
    known = set(json.loads(export_qaic.SUPPORTED_OPS.read_text())["ops"])
    for e in (smollm2_exports, codegen_exports):
        for role in ("target", "draft"):
            graph = onnx.load(str(e[role] / "model.onnx"), load_external_data=False).graph
            ops = {node.op_type for node in graph.node}
            assert ops == set(json.loads((e[role] / "qaic.json").read_text())["ops"])
            assert ops <= known and "IsNaN" not in ops and "Softmax" in ops
            producers = {name: node for node in graph.node for name in node.output}
            for node in graph.node:
                if node.op_type == "ArgMax":
                    cast = producers[node.input[0]]
                    assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.INT32


def scatter_indices(directory: Path, feeds: dict) -> np.ndarray:
    """The index triples of the ScatterND that writes layer 0's keys, for one call."""
    from onnx.reference import ReferenceEvaluator
    graph_model = onnx.load(str(directory / "model.onnx"))
    scatter = next(n for n in graph_model.graph.node if n.output[0] == "past_key.0_RetainedState")
    return ReferenceEvaluator(graph_model).run([scatter.input[1]], feeds)[0]


def test_padding_writes_no_duplicate_index(codegen_exports):
    """A padded call writes distinct (row, head, slot) triples, also where its padding runs past the last slot."""
    e = codegen_exports
    meta = json.loads((e["target"] / "qaic.json").read_text())
    past = {f"past_{kind}.{i}": np.zeros((1, meta["n_kv_heads"], CODEGEN_CTX, meta["head_dim"]), np.float32)
            for i in range(meta["n_layers"]) for kind in ("key", "value")}
    for start, n in ((10, 3), (CODEGEN_CTX - 2, 2), (CODEGEN_CTX - 1, 1)):
        positions = np.full((1, K + 1), -1, np.int64)
        positions[0, :n] = np.arange(start, start + n)
        feeds = dict(input_ids=np.zeros((1, K + 1), np.int64), position_ids=positions,
                     num_logits_to_keep=np.zeros((K + 1, 1), np.int64), **past)
        index = scatter_indices(e["target"], feeds).reshape(-1, 3)
        assert len({tuple(i) for i in index}) == len(index) == meta["n_kv_heads"] * (K + 1)
        assert (index[:, 2] < CODEGEN_CTX).all() and (index[:, 2] >= 0).all()


def test_a_longer_context_than_exported(codegen_exports):
    """The rotary tables cover the model's every position: the graph run with caches longer than the export's
    ctx_len (as a compile for a longer context runs it) matches model.py at positions past that ctx_len."""
    import onnxruntime
    e = codegen_exports
    model = load_model(e["ckpt"], "cpu", torch.float32)
    length = model.args.max_seq_len
    assert length > CODEGEN_CTX
    model.setup_caches(1, length)
    tokens = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens, torch.arange(length)[None])[0].numpy()
    session = onnxruntime.InferenceSession(str(e["draft"] / "model.onnx"), providers=["CPUExecutionProvider"])
    meta = json.loads((e["draft"] / "qaic.json").read_text())
    past = {f"past_{kind}.{i}": np.zeros((1, meta["n_kv_heads"], length, meta["head_dim"]), np.float32)
            for i in range(meta["n_layers"]) for kind in ("key", "value")}
    for start in range(0, length, PREFILL):
        logits, *state = session.run(None, dict(input_ids=tokens[:, start:start + PREFILL].numpy(),
                                                position_ids=np.arange(start, start + PREFILL)[None], **past))
        past = dict(zip(past, state))
    np.testing.assert_allclose(logits[0, 0], expected[-1], rtol=LOGITS_TOL, atol=LOGITS_TOL)


def test_weights_in_chunks(codegen_exports, tmp_path):
    """External data in files of at most the chunk size (a 7B fp32 export is three files of <= 10 GiB, not one of
    27 GB); the chunked graph computes what the one-file graph does."""
    e = codegen_exports
    out = export(e["ckpt"], tmp_path / "target", "target", CODEGEN_CTX, chunk_bytes=100_000)
    files = sorted(out.glob("model.onnx.data*"))
    assert len(files) >= 3 and all(f.stat().st_size <= 100_000 for f in files)
    assert files[0].name == "model.onnx.data" and files[1].name == "model.onnx.data.1"
    onnx.checker.check_model(str(out / "model.onnx"))
    chunked, single = (run_onnx.ExportedModel(d, "target") for d in (out, e["target"]))
    tokens = list(range(3, 40))
    np.testing.assert_array_equal(chunked.prefill(tokens), single.prefill(tokens))


def test_specializations_never_repeat(tmp_path):
    """A target whose prefill is as long as its decode keeps two entries (they keep different logits); a draft
    whose prefill is one token has one."""
    args = ModelArgs(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=128)
    for role, prefill, want in (("target", K + 1, [(K + 1, 1), (K + 1, K + 1)]), ("draft", 1, [(1, None)]),
                                ("draft", PREFILL, [(PREFILL, None), (1, None)])):
        opts = export_qaic.build_parser().parse_args(["--checkpoint_path", "x", "--output_dir", "x", "--role", role,
                                                      "--speculate_k", str(K), "--prefill_len", str(prefill)])
        export_qaic.side_files(tmp_path, opts, args, export_qaic.check_options(opts), [])
        entries = json.loads((tmp_path / "specializations.json").read_text())["specializations"]
        got = [(int(x["seq_len"]), int(x["num_logits_to_keep"]) if "num_logits_to_keep" in x else None) for x in entries]
        assert got == want


def test_core_split():
    assert [export_qaic.core_split(text, role) for text, role in
            (("11/5", "target"), ("11/5", "draft"), ("16", "target"), ("8", "draft"))] == [11, 5, 16, 8]


def test_an_edited_norm_or_attention_is_refused(monkeypatch):
    """The export swaps model.py's norms and attention only after proving the swap computes what model.py does: a
    fork that edits them (here Gemma's (1 + w) norm, and a softcapped attention) gets a one-line refusal."""
    args = ModelArgs(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=128)
    original = model_lib.RMSNorm.forward
    monkeypatch.setattr(model_lib.RMSNorm, "forward", lambda self, x: original(self, x) + original(self, x) / self.weight)
    with pytest.raises(InputError, match=r"^model.py's RMSNorm.forward differs from the export's float16-safe form"):
        export_qaic.use_float16_safe_modules(Transformer(args))
    monkeypatch.undo()
    attend = model_lib.Attention.attend
    monkeypatch.setattr(model_lib.Attention, "attend", lambda self, q, k, v, p: attend(self, 30 * torch.tanh(q / 30),
                                                                                       k, v, p))
    with pytest.raises(InputError, match=r"^model.py's Attention.attend differs"):
        export_qaic.use_float16_safe_modules(Transformer(args))

