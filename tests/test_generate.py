"""generate.py: real-weight greedy parity with transformers, compile-once decode, the CLI and its errors."""
import json
import subprocess
import sys

import pytest
import torch

from bench import humaneval_tasks
from conftest import ROOT
from generate import Steps, generate, load_model, logits_to_probs
from model import ModelArgs, Transformer
from tokenizer import Tokenizer


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """transformers' forward with its own KV cache, argmax each step, EOS not special (exactly n tokens)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_smollm2_greedy_fp32_matches_transformers(smollm2, hf_smollm2):
    ckpt, _ = smollm2
    hf, _ = hf_smollm2
    tokenizer = Tokenizer(ckpt)
    model = load_model(ckpt, "cpu", torch.float32)
    prompts = [tokenizer.encode(t["prompt"]) for t in humaneval_tasks(3)]
    alone = []
    for prompt in prompts:
        rows, _ = generate(model, [prompt], 64, Steps())
        assert rows[0] == hf_greedy(hf, prompt, 64)
        alone.append(rows[0])
    # The three prompts (different lengths) as one ragged batch: every row equals its run alone.
    rows, _ = generate(model, prompts, 64, Steps())
    assert rows == alone


def tiny_model():
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def test_compiled_decode_compiles_once_across_prompt_lengths():
    from torch._dynamo.utils import counters
    model = tiny_model()
    steps = Steps(compile=True)
    torch._dynamo.reset()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 17, 40, 3)]
    eager = [generate(model, [p], 12, Steps())[0][0] for p in prompts]
    compiled = [generate(model, [prompts[0]], 12, steps)[0][0]]
    frames = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled += [generate(model, [p], 12, steps)[0][0] for p in prompts[1:]]
    assert counters["stats"]["unique_graphs"] == frames
    assert compiled == eager
    # A new batch size is a new static shape: one more graph, and the ragged rows still equal their runs alone.
    rows, _ = generate(model, prompts[:2], 12, steps)
    assert rows == eager[:2] and counters["stats"]["unique_graphs"] == frames + 1


def test_top_k_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (logits_to_probs(logits, 1.0, top_k=2) > 0).tolist() == [True, True, False, False, False]
    assert (logits_to_probs(logits, 1.0, top_p=0.7) > 0).tolist() == [True, True, False, False, False]
    assert (logits_to_probs(logits, 1.0, top_p=0.71) > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(logits_to_probs(logits, 1.0), logits.softmax(-1))
    cold = logits_to_probs(logits, 0.5)
    torch.testing.assert_close(cold, (logits / 0.5).softmax(-1))


def cli(*args, script="generate.py"):
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_json_lines_and_seed(tiny):
    ckpt, _ = tiny("llama_gqa_tied")
    common = ["--checkpoint_path", str(ckpt), "--prompt", "hello", "--max_new_tokens", "6", "--json",
              "--dtype", "fp32", "--batch_size", "2", "--num_samples", "3", "--temperature", "1.0", "--seed", "7"]
    first, second = cli(*common), cli(*common)
    assert first.returncode == 0, first.stderr
    lines = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(lines) == 6
    for record in lines:
        for key in ("prompt_tokens", "tokens", "text", "tokens_per_s", "bandwidth_gb_s", "compile_s"):
            assert key in record
        assert record["prompt_tokens"] == 5 and 1 <= len(record["tokens"]) <= 6
    # The same --seed gives the same samples (timings differ, so compare tokens).
    assert [r["tokens"] for r in lines] == [json.loads(x)["tokens"] for x in second.stdout.splitlines()]
    assert len({tuple(r["tokens"]) for r in lines}) > 1  # sampling at temperature 1 does vary across samples


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_bad_input_gives_one_line_errors(tiny, tmp_path):
    ckpt, _ = tiny("llama_gqa_tied")
    assert_one_line_error(cli("--checkpoint_path", str(tmp_path / "missing")), "missing", "not found")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--dtype", "fp64"), "--dtype fp64")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt / "config.json")), "expected a checkpoint directory")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--speculate_k", "0"), "--speculate_k")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--draft", "ngram", "--draft_checkpoint", str(ckpt)),
                          "--draft ngram uses no model")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--prompt", "300", "--max_new_tokens", "10"),
                          "exceeds the model's context of 256")

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((ckpt / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(config, intermediate_size=64)))
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "feed_forward.w1.weight' has shape [128, 64]",
                          "implies [64, 64]")
    (broken / "config.json").write_text(json.dumps(dict(config, n_kv_heads=3)))
    assert_one_line_error(cli("--checkpoint_path", str(broken)), str(broken / "config.json"), "inconsistent")
    del config["n_layers"]
    (broken / "config.json").write_text(json.dumps(config))
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "config.json", "missing field 'n_layers'")

    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    data = (ckpt / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "model.safetensors", "truncated or corrupt")
    (broken / "model.safetensors").write_bytes(b"garbage")
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "model.safetensors", "corrupt")
    (broken / "tokenizer.json").unlink()
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "no tokenizer.json")


def test_a_compiled_step_refuses_a_second_model():
    """CompiledStep drops dynamo's module guards, which is sound only while one model reaches its graphs."""
    import weakref
    from generate import CompiledStep, decode_one_token
    first, second = tiny_model(), tiny_model()
    step = CompiledStep(decode_one_token)
    step.model = weakref.ref(first)  # as after a first call, without compiling
    with pytest.raises(ValueError, match="serves another model"):
        step(second, torch.tensor([1]), torch.tensor([0]), 0.0, None, None)
