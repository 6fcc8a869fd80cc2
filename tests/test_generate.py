"""generate.py: real-weight greedy parity with transformers, compile-once decode, the CLI and its errors."""
import contextlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import generate as generate_cli
from conftest import ROOT
from decoding import Steps, generate
from loading import load_model
from model import ModelArgs, Transformer
from cli import humaneval_tasks
from speculative import argmax, logits_to_probs
from decoding import ThreadSizer
from tokenizer import TextStream, Tokenizer


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax(dtype):
    """sampling.argmax (greedy decode, verify, the exponential race) gives torch.argmax's index: the first of tied
    maxima (logits rounded to integers make many ties), the first NaN wherever the maximum is, and index 0 for a
    row of -inf."""
    torch.manual_seed(0)
    for shape in [(5, 49152), (1, 49152), (3, 7), (2, 3, 45)]:
        cases = [torch.randn(shape), (torch.randn(shape) * 2).round(), torch.full(shape, float("-inf"))]
        for nan_at in (0, shape[-1] // 2, shape[-1] - 1):
            x = (torch.randn(shape) * 2).round()
            x[..., nan_at] = float("nan")
            x[..., -1 - nan_at] = float("nan")
            cases.append(x)
        for x in cases:
            x = x.to(dtype)
            assert torch.equal(argmax(x), x.argmax(-1)), shape


def test_top_k_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (logits_to_probs(logits, 1.0, top_k=2) > 0).tolist() == [True, True, False, False, False]
    assert (logits_to_probs(logits, 1.0, top_p=0.7) > 0).tolist() == [True, True, False, False, False]
    assert (logits_to_probs(logits, 1.0, top_p=0.71) > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(logits_to_probs(logits, 1.0), logits.softmax(-1))
    cold = logits_to_probs(logits, 0.5)
    torch.testing.assert_close(cold, (logits / 0.5).softmax(-1))


def cli(*args, script="generate.py"):
    """generate.py's main(argv) in this process: (exit status, stdout, stderr) as a subprocess would give them, without
    a process's start-up (~7 s of imports here); another script runs in a process of its own (process()).
    test_a_process_gives_one_line_errors runs generate.py's process itself."""
    if script != "generate.py":
        return process(*args, script=script)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            generate_cli.main([str(a) for a in args])
        except SystemExit as e:  # sys.exit("error: ...") prints its message, as the interpreter would
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def process(*args, script="generate.py"):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
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


def test_verbose_says_what_the_backend_serves(tiny):
    """--verbose prints the backend's report: the CPU backend's kernels, or model.py alone with --backend torch."""
    ckpt, _ = tiny("llama_gqa_tied")
    common = ["--checkpoint_path", str(ckpt), "--prompt", "hello", "--max_new_tokens", "2", "--verbose", "--dtype", "fp32"]
    lines = {backend: [line for line in cli(*common, "--backend", backend).stderr.splitlines()
                       if line.startswith("backend ")] for backend in ("auto", "torch")}
    assert len(lines["auto"]) == 1 and lines["auto"][0].startswith(
        "backend cpu: few_rows.cpp: 9 products (9 plain in dense rows, "), lines
    assert lines["auto"][0].endswith(("; no AMX tiles on this CPU", "; AMX tiles serve the int4, int4k, int8 and "
                                      "integer MX products of 2+ rows", "; AVX-512 serves")), lines
    assert lines["torch"] == ["backend torch: nothing (model.py's PyTorch)"], lines


def test_slow_paths_say_so_in_one_line_with_the_faster_choice(tiny):
    """No silent slow path on a CPU: fp16 (no kernel takes it), --backend torch without --compile (model.py eagerly);
    each says what the user gets and the faster choice in one line. The served default says none of them, and
    --compile compiles the served model's steps (it says how long that took)."""
    ckpt, _ = tiny("llama_gqa_tied")
    common = ["--checkpoint_path", str(ckpt), "--prompt", "hello", "--max_new_tokens", "2"]

    def lines(*flags):
        result = cli(*common, *flags)
        assert result.returncode == 0, result.stderr
        return [line for line in result.stderr.splitlines() if line.startswith(("warning:", "note:"))], result.stderr
    assert lines()[0] == []
    said, _ = lines("--dtype", "fp16")
    assert len(said) == 1 and "fp16" in said[0] and "--dtype bf16 (the default) or fp32" in said[0], said
    said, _ = lines("--backend", "torch")
    assert len(said) == 1 and "--backend torch runs model.py eagerly" in said[0] and "add --compile" in said[0], said
    said, err = lines("--compile")
    assert said == [] and "compiled in" in err, err


def test_a_request_s_plan_is_made_once(tiny, monkeypatch):
    """generate.py makes a request's plan (K, the cache) once, before loading, and the loop takes it: one plan for
    two samples of a speculative request, none made again in decoding.generate."""
    import decoding
    ckpt, _ = tiny("llama_gqa_tied")
    made = []

    def counted(*args, **kwargs):
        made.append(args[1:])
        return plan(*args, **kwargs)
    plan = decoding.plan
    monkeypatch.setattr(decoding, "plan", counted)
    monkeypatch.setattr(generate_cli, "plan", counted)
    result = cli("--checkpoint_path", str(ckpt), "--prompt", "hello", "--max_new_tokens", "8", "--draft", "ngram",
                 "--speculate_k", "3", "--num_samples", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert len(made) == 1, made


def test_each_checkpoint_is_resolved_and_its_config_read_once(tiny, monkeypatch):
    """The target's and the draft's paths are resolved and their config.json read once a request (generate.py's
    checks, the tokenizers' special ids included), and loading takes what they read: with the draft's int8 copy
    written and loaded, two reads of config.json in all (eight before)."""
    import pathlib
    ckpt, _ = tiny("llama_gqa_tied")
    read = []

    def counted(path, *args, **kwargs):
        if path.name == "config.json":
            read.append(str(path))
        return read_text(path, *args, **kwargs)
    read_text = pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_text", counted)
    result = cli("--checkpoint_path", str(ckpt), "--prompt", "hello", "--max_new_tokens", "8", "--draft_checkpoint",
                 str(ckpt), "--draft_quantize", "int8", "--speculate_k", "3", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert len(read) == 2, read  # the target's, the draft's


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_process_gives_one_line_errors(tiny, tmp_path):
    """The contract as a user meets it, in a process of its own: one line on stderr, exit status 1, no traceback (the
    other tests call main in-process)."""
    ckpt, _ = tiny("llama_gqa_tied")
    result = process("--checkpoint_path", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert_one_line_error(result, "missing", "not found")
    assert_one_line_error(process("--checkpoint_path", str(ckpt), "--dtype", "fp64"), "--dtype fp64")


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
    assert_one_line_error(cli("--checkpoint_path", str(broken)), "feed_forward.w1.weight' has 128 output rows",
                          "implies 64")
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


def broken_copy(ckpt: Path, directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return directory


def edited(config: dict, **changes) -> str:
    """config.json text with these fields changed (a value of ... deletes the field)."""
    return json.dumps({k: v for k, v in {**config, **changes}.items() if v is not ...})


@pytest.mark.parametrize("case", ["not JSON", "empty", "a list", "null", "n_heads 0", "dim as text", "n_layers true",
                                  "rope_theta deleted", "norm_eps NaN", "rope_scaling without factor"])
def test_bad_config_json_gives_one_line_errors(tiny, tmp_path, case):
    """Every config.json the loader or the tokenizer reads is checked: not JSON, not an object, a field of the wrong
    type or out of range, a required field missing (rope_theta: a missing one once ran with a default and changed
    the output). Each ends in one line naming the file and the field."""
    ckpt, _ = tiny("llama_gqa_tied")
    broken = broken_copy(ckpt, tmp_path / "broken")
    config = json.loads((ckpt / "config.json").read_text())
    text, message = {
        "not JSON": ("{", "not valid JSON"),
        "empty": ("", "not valid JSON"),
        "a list": ("[]", "not a JSON object"),
        "null": ("null", "not a JSON object"),
        "n_heads 0": (edited(config, n_heads=0), "'n_heads' must be a positive integer, not 0"),
        "dim as text": (edited(config, dim="576"), "'dim' must be a positive integer, not '576'"),
        "n_layers true": (edited(config, n_layers=True), "'n_layers' must be a positive integer, not True"),
        "rope_theta deleted": (edited(config, rope_theta=...), "missing field 'rope_theta'"),
        "norm_eps NaN": (edited(config, norm_eps=float("nan")), "'norm_eps' must be a finite number >= 0"),
        "rope_scaling without factor": (edited(config, rope_scaling={"rope_type": "llama3"}), "rope_scaling"),
    }[case]
    (broken / "config.json").write_text(text)
    assert_one_line_error(cli("--checkpoint_path", str(broken)), str(broken / "config.json"), message)


def safetensors_bytes(header) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(64)


@pytest.mark.parametrize("header,message", [
    ({"tok_embeddings.weight": {"dtype": "F32", "shape": [2, 2]}}, "'tok_embeddings.weight' has no valid data_offsets"),
    ({"tok_embeddings.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, "16"]}}, "data_offsets"),
    ({"tok_embeddings.weight": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, "shape"),
    ({"tok_embeddings.weight": "F32"}, "'tok_embeddings.weight' is not a tensor entry"),
    ([], "header is not a JSON object"),
    ({"__metadata__": [1]}, "__metadata__"),
])
def test_bad_safetensors_headers_give_one_line_errors(tiny, tmp_path, header, message):
    ckpt, _ = tiny("llama_gqa_tied")
    broken = broken_copy(ckpt, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(safetensors_bytes(header))
    assert_one_line_error(cli("--checkpoint_path", str(broken)), str(broken / "model.safetensors"), message)


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--top_p", "nan"], "--top_p"),
    (["--draft", "ngram", "--speculate_k", "17"], "--speculate_k 17: at most 16 (or auto): a longer verify paid"),
    (["--draft", "ngram", "--speculate_k", "1000"], "--speculate_k 1000: at most 16"),
    (["--backend", "cuda"], "--backend cuda: unknown; use auto or torch"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: not available")]))
def test_cli_rejects_numbers_out_of_range(tiny, flags, message):
    ckpt, _ = tiny("llama_gqa_tied")
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), *flags), message)


def test_the_stream_ends_with_the_json_text_and_a_newline(tiny, capsys):
    """Output that stops inside a multi-byte character: the stream held the partial character back and, at the end,
    prints what --json's text holds (the replacement character), then a newline."""
    ckpt, _ = tiny("llama_gqa_tied")
    tokenizer = Tokenizer(ckpt)
    ids = tokenizer.encode("aé")[:-1]  # byte-level: 'a' and the first byte of 'é'
    stream = TextStream(tokenizer)
    stream(ids[:1])
    stream(ids[1:])
    assert capsys.readouterr().out == "a"
    stream.finish()
    assert capsys.readouterr().out == tokenizer.decode(ids)[1:] + "\n"
    result = cli("--checkpoint_path", str(ckpt), "--prompt", "hi", "--max_new_tokens", "4", "--dtype", "fp32")
    assert result.returncode == 0 and result.stdout.endswith("\n"), result


def interrupted(args, script, marker: str, stream="stderr"):
    """Run a CLI, send it SIGINT (Ctrl-C) once `marker` appears on `stream`; returns (exit status, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen = {"stdout": bytearray(), "stderr": bytearray()}

    def drain(name):
        pipe = getattr(proc, name)
        while chunk := pipe.read1(4096):
            seen[name] += chunk

    readers = [threading.Thread(target=drain, args=(name,), daemon=True) for name in seen]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 240
    while marker.encode() not in seen[stream] and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, (marker, bytes(seen["stderr"])[-2000:])
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    for reader in readers:
        reader.join(timeout=10)
    return proc.returncode, seen["stdout"].decode(errors="replace"), seen["stderr"].decode(errors="replace")


def assert_interrupted(status, err):
    assert status == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted"), err[-3000:]


def test_ctrl_c_ends_generate_with_one_line(smollm2):
    ckpt, _ = smollm2
    status, out, err = interrupted(["--checkpoint_path", ckpt, "--prompt", "def f(x):", "--max_new_tokens", "4000",
                                    "--temperature", "0"], "generate.py", "def f(x):", stream="stdout")
    assert_interrupted(status, err)
    assert out.startswith("def f(x):") and out.endswith("\n")


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads the load of the other cores from /proc/stat")
@pytest.mark.skipif(not 2 <= torch.get_num_threads() == len(getattr(os, "sched_getaffinity", lambda _: ())(0)),
                    reason="needs two threads or more, one per CPU, so that a busy process takes one of ours")
def test_decoding_gives_a_core_to_a_busy_process(smollm2):
    """Threads that wait for each other lose their turn to a busy process on a shared core (plain bf16 decode on
    SmolLM2 fell from ~140 to ~41 tok/s here, one thread ran ~117): the loop runs at least one thread fewer while
    other processes keep the cores it does not use and one more busy, however busy the machine was before, and
    leaves the thread count as it found it."""
    ckpt, _ = smollm2
    model = load_model(ckpt, "cpu", torch.bfloat16)
    prompt = Tokenizer(ckpt).encode("def f(x):")
    most = torch.get_num_threads()
    if most < 2:
        pytest.skip("one thread: nothing to give")
    spare = max(len(os.sched_getaffinity(0)) - most, 0)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spare + 1)]
    try:
        time.sleep(0.5)
        _, loaded = generate(model, [prompt], 96, Steps())
    finally:
        for process in busy:
            process.kill()
            process.wait(timeout=60)
    assert loaded["threads"] <= most - 1, (most, loaded["threads"])
    assert torch.get_num_threads() == most


def test_threads_follow_what_the_others_take():
    """ThreadSizer's rule, one look at a time: one thread fewer once the others take 0.3 of a core beyond those
    given up, one more once they take under 0.2 of the last one given up; never below 1 or above the start."""
    resized = ThreadSizer.resized
    assert [resized(4, 4, taken) for taken in (0.0, 0.29, 0.31, 3.0)] == [4, 4, 3, 3]
    assert [resized(3, 4, taken) for taken in (0.19, 0.21, 1.0, 1.31)] == [4, 3, 3, 2]
    assert resized(1, 4, 9.0) == 1 and resized(4, 4, -1.0) == 4
    threads, seen = 8, []
    for taken in [0, 2.5, 2.5, 2.5, 2.5, 2.5, 0.1, 0.1, 0.1, 0.1]:  # two busy processes and a half come and go
        threads = resized(threads, 8, taken)
        seen.append(threads)
    assert seen == [8, 7, 6, 5, 5, 5, 6, 7, 8, 8]


def test_decoding_several_steps_between_host_syncs_gives_the_same_rows():
    """sync_every (8 on CUDA: the host looks at the tokens once per 8 steps) changes nothing a caller sees: a ragged
    batch whose rows end at an EOS inside a chunk, and one that runs to max_new_tokens, compiled and eager."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                                  max_seq_len=256)).eval()
    prompts = [[1, 5, 9, 13, 17], [2, 4], [7, 7, 7, 3]]
    free, _ = generate(model, prompts, 30, Steps())
    eos = free[1][10]  # row 1 ends at its 11th token (inside the second chunk of 8); others where that token comes
    expected, stats = generate(model, prompts, 30, Steps(), eos_ids=(eos,))
    assert len(expected[1]) == 11 and expected[1][-1] == eos
    for steps in (Steps(), Steps(compile=True)):
        for sync_every in (3, 8, 64):
            seen = []
            rows, chunked = generate(model, prompts, 30, steps, eos_ids=(eos,), sync_every=sync_every,
                                     on_token=seen.extend)
            assert rows == expected, sync_every
            assert seen == expected[0]
            assert chunked["decode_steps"] >= stats["decode_steps"]  # past a row's end at most sync_every - 1


def test_compile_prefill_and_speculate_k_auto_from_the_command_line(tiny):
    """--compile_prefill (prefill traced with dynamic shapes) and --speculate_k auto (AdaptiveK picks K each round,
    here with a draft that is often wrong) give the tokens of plain greedy decoding."""
    ckpt, _ = tiny("llama3_rope_scaling")
    draft, _ = tiny("llama_gqa_tied")
    common = ["--checkpoint_path", ckpt, "--prompt", "def add(a, b):", "--max_new_tokens", "40", "--temperature",
              "0", "--dtype", "fp32", "--json"]
    runs = {}
    for name, extra in [("plain", []), ("compile_prefill", ["--compile_prefill"]),
                        ("auto", ["--draft_checkpoint", draft, "--speculate_k", "auto"])]:
        done = cli(*common, *extra)
        assert done.returncode == 0, (name, done.stderr)
        runs[name] = json.loads(done.stdout.splitlines()[-1])
    assert len(runs["plain"]["tokens"]) == 40 and len(set(runs["plain"]["tokens"])) > 5
    assert runs["compile_prefill"]["tokens"] == runs["plain"]["tokens"]
    assert runs["auto"]["tokens"] == runs["plain"]["tokens"]
    assert runs["auto"]["alpha"] < 0.9 and sum(runs["auto"]["accept_counts"]) > 1, runs["auto"]
