"""scripts/bench.py: its errors, and the idle / busy table of --contended."""
import pytest

from test_generate import assert_one_line_error, cli


def test_bench_errors_are_one_line(smollm2, tmp_path):
    ckpt, _ = smollm2
    assert_one_line_error(cli("--checkpoint_path", str(tmp_path / "nope"), script="scripts/bench.py"), "nope",
                          "not found")
    # an unknown mode names the ones there are, not a quantize.py command that would fail too
    result = cli("--checkpoint_path", str(ckpt), "--rows", "compiled,quant-int3", script="scripts/bench.py")
    assert_one_line_error(result, "quant-int3", "int8, int4, int4k, mxfp8")
    assert "quantize.py" not in result.stderr
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--rows", "compiled,spec-ngram-17",
                              script="scripts/bench.py"), "spec-ngram-17", "at most 16")


def test_contended_reports_idle_and_busy_side_by_side(smollm2):
    ckpt, _ = smollm2
    result = cli("--checkpoint_path", str(ckpt), "--rows", "compiled,spec-ngram-4", "--num_prompts", "1", "--runs",
                 "1", "--max_new_tokens", "16", "--contended", script="scripts/bench.py")
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert "idle tok/s" in table[0] and "busy tok/s" in table[0] and "busy / idle" in table[0]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["ours, compiled", "spec-ngram-4"]


def test_quantized_targets_and_drafts_side_by_side(quantized, tmp_path):
    """The pair's rows on SmolLM2 drafting for itself: a quantized target (quant-int8) plain and drafted by the draft's
    quantized file (quant-int8+spec-draft.int4-3), whose tokens are compared with its own target's plain row; a
    quantized target without its plain row has nothing to compare with ('-')."""
    ckpt = quantized["int8"].parent
    rows = "quant-int8,quant-int8+spec-draft.int4-3,quant-int4+spec-ngram"
    result = cli("--checkpoint_path", str(ckpt), "--draft_checkpoint", str(ckpt), "--rows", rows, "--num_prompts",
                 "2", "--runs", "1", "--max_new_tokens", "16", script="scripts/bench.py")
    assert result.returncode == 0, result.stderr[-3000:]
    speed_table = result.stdout.split("speculative rows")[0]
    table = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in speed_table.splitlines()
             if line.startswith("| ") and "tok/s" not in line}
    assert table["quant-int8+spec-draft.int4-3"] == "2/2"
    assert table["quant-int4+spec-ngram"] == "-"
    for name in ("config.json", "tokenizer.json", "model.safetensors"):  # a draft without quantized files
        (tmp_path / name).symlink_to(ckpt / name)
    for bad, words in (("quant-int8+spec-draft.int3-2", ("unknown drafter 'draft.int3'",)),
                       ("quant-int8+ngram", ("after '+' comes a speculative row",)),
                       ("spec-draft.mxfp6", (str(tmp_path / "model.mxfp6.safetensors"), "not found"))):
        assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--draft_checkpoint", str(tmp_path), "--rows", bad,
                                  script="scripts/bench.py"), *words)


def test_random_weights_need_no_checkpoint(tmp_path):
    """--random_weights CONFIG: the shapes of a config.json with random weights, quantized in memory for quant-MODE
    rows and copied for spec-self / spec-MODE drafts (every draft accepted: alpha 1)."""
    import json
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(family="llama", vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                      intermediate_size=256, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True,
                                      max_seq_len=512, bos_token_id=1, eos_token_id=2, add_bos_token=False)))
    result = cli("--random_weights", str(config), "--rows", "compiled,quant-int4,quant-mxfp6,spec-self-2",
                 "--num_prompts", "1", "--runs", "1", "--max_new_tokens", "12", script="scripts/bench.py")
    assert result.returncode == 0, result.stderr[-3000:]
    tables = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [t[0].strip() for t in tables[:5]] == ["row", "ours, compiled", "quant-int4", "quant-mxfp6", "spec-self-2"]
    alpha = [c.strip() for c in tables[5]].index("alpha")  # the speculative rows' table
    assert "GB/s" in tables[0][2] and tables[6][alpha].strip() == "1.000"  # spec-self-2's alpha
    for args, words in ((["--random_weights", str(config), "--rows", "compiled,hf"], ("--rows hf", "real weights")),
                        (["--rows", "compiled"], ("--checkpoint_path or --random_weights",)),
                        (["--random_weights", str(config), "--rows", "spec-random-2", "--draft_config",
                          str(tmp_path / "nope.json")], ("nope.json", "not found")),
                        (["--random_weights", str(config), "--device", "cuda:7"], ("--device cuda:7", "not available"))):
        assert_one_line_error(cli(*args, script="scripts/bench.py"), *words)


def test_a_killed_bench_leaves_no_busy_loop(tmp_path):
    """--contended's busy loop spins only while its parent lives: a bench killed outright (SIGKILL, no cleanup)
    leaves no process burning a core."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from conftest import ROOT, read_line
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path[:0] = [sys.argv[1], sys.argv[1] + "
                               "'/scripts']\nfrom bench import BusyProcess\nwith BusyProcess() as busy:\n"
                               "    print(busy.process.pid, flush=True)\n    time.sleep(600)", str(ROOT)],
                              stdout=subprocess.PIPE, text=True)
    spinner = int(read_line(holder.stdout, 120))
    os.kill(spinner, 0)  # spinning
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(spinner, 0)
        except ProcessLookupError:
            return
        state = open(f"/proc/{spinner}/stat").read().split(")")[1].split()[0] if os.path.exists(f"/proc/{spinner}") \
            else "gone"
        if state == "Z":  # exited, not yet reaped by its new parent
            return
        time.sleep(0.1)
    os.kill(spinner, signal.SIGKILL)
    raise AssertionError("the busy loop outlived the bench that started it")


def test_bench_load_times_fresh_processes(tiny, capsys):
    """scripts/bench_load.py: a row per file with the three runs (eager, compiled with an empty Inductor cache, then
    with the cache the first left)."""
    import bench_load
    ckpt, _ = tiny("llama_gqa_tied")
    bench_load.main(["--checkpoint_path", str(ckpt), "--files", "bf16", "--runs", "1"])
    table = capsys.readouterr().out.splitlines()
    assert table[1] == "| file | eager | compiled, cold | compiled, cached | of which load_model |"
    assert table[3].startswith("| bf16 |")
    with pytest.raises(SystemExit, match="--files mxfp9: not a file kind; give bf16 or quantize.py modes"):
        bench_load.main(["--checkpoint_path", str(ckpt), "--files", "bf16,mxfp9"])


def test_the_rows_check_script_reports_every_mode(tiny):
    """scripts/verify_rows.py, a part of scripts/gpu_check.sh, on the CPU with model.py alone: one line a mode with the
    longest verify that computes each row as a decode step does (model.py's bf16 here: every row), then with
    --compiled a line a mode for the compiled step; a missing config, an unknown device or an unknown
    --compiled mode is one line."""
    import re
    ckpt, _ = tiny("llama_gqa_tied")
    result = cli(ckpt / "config.json", "--device", "cpu", "--backend", "torch", script="scripts/verify_rows.py")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["bf16", "int8", "int4", "int4k", "mxfp6", "mxfp4"], result.stdout
    for line in lines:
        assert re.fullmatch(r"\w+: verify rows computed as a decode step computes them: 1 to 17 \([\d.]+ s\)", line), line
    # the step compiled on two layers, served by the CPU backend: a verify's logits are the decode steps', bit for bit
    result = cli(ckpt / "config.json", "--device", "cpu", "--compiled", "bf16,int4k", script="scripts/verify_rows.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for mode, line in zip(["bf16", "int4k"], result.stdout.splitlines()[-2:]):
        assert re.fullmatch(rf"{mode}, compiled, 2 layers: a verify of 8 tokens and 8 decode steps: bit for bit "
                            r"\([\d.]+ s\)", line), line
    assert_one_line_error(cli(ckpt / "nope.json", "--device", "cpu", script="scripts/verify_rows.py"), "nope.json",
                          "not found")
    assert_one_line_error(cli(ckpt / "config.json", "--device", "tpu", script="scripts/verify_rows.py"),
                          "--device tpu: not supported")
    result = cli(ckpt / "config.json", "--device", "cpu", "--compiled", "bf16,int5", script="scripts/verify_rows.py")
    assert result.stdout == "", result.stdout  # refused before the rows check runs
    assert_one_line_error(result, "--compiled: unknown mode 'int5'")


def test_the_products_benchmark_prints_a_line_as_each_cell_finishes(tiny):
    """scripts/bench_products.py, the first part of scripts/gpu_check.sh, at a tiny model's shapes: a line per format
    and rows on the CPU backend, and on the Triton rows kernels in Triton's interpreter (TRITON_INTERPRET=1), as a GPU
    runs them; an unknown mode is one line."""
    import importlib.util
    import os
    import re
    import subprocess
    import sys
    from conftest import ROOT
    ckpt, _ = tiny("llama_gqa_tied")
    config = ckpt / "config.json"
    for extra, env in (([], {}), (["--triton", "--modes", "bf16,int4k,mxfp6"], {"TRITON_INTERPRET": "1"})):
        if extra and importlib.util.find_spec("triton") is None:
            continue
        result = subprocess.run([sys.executable, "scripts/bench_products.py", str(config), "--device", "cpu", "--rows",
                                 "1,3", "--repeats", "1", *extra], capture_output=True, text=True, cwd=ROOT,
                                env=dict(os.environ, **env), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = result.stdout.splitlines()
        modes = extra[-1].split(",") if extra else ["bf16", "int8", "int4", "int4k", "mxfp6", "mxfp4"]
        assert lines[0].startswith("# one layer of ") and len(lines) == 1 + 2 * len(modes), result.stdout
        for line, (mode, rows) in zip(lines[1:], [(m, r) for m in modes for r in (1, 3)]):
            assert re.fullmatch(rf" *{mode} +{rows} rows: +[\d.]+ ms +[\d.]+ GB/s +[\d.]+x the first cell's time",
                                line), line
    assert_one_line_error(cli(config, "--device", "cpu", "--modes", "int3", script="scripts/bench_products.py"),
                          "--modes int3: unknown")


def test_bench_rows_prints_every_format_and_row_count(quantized, capsys):
    """scripts/bench_rows.py: a table row per format and tokens a row, the first format's decode the 100% its GB/s
    are held to and each format's first row count its own decode (v = 1.00); an unknown mode is one line."""
    import bench_rows
    ckpt = quantized["int8"].parent
    bench_rows.main(["--checkpoint_path", str(ckpt), "--modes", "bf16,int4", "--rows", "1,8", "--repeats", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows] == ["format", "bf16", "bf16", "int4", "int4"]
    assert [r[1].strip() for r in rows[1:]] == ["1", "8", "1", "8"]
    assert rows[1][4].strip() == "100%" and rows[1][5].strip() == rows[3][5].strip() == "1.00"
    with pytest.raises(SystemExit, match="--modes: unknown mode 'int3'"):
        bench_rows.main(["--checkpoint_path", str(ckpt), "--modes", "bf16,int3"])


def test_bench_fork_takes_turns_in_long_lived_processes(tiny, tmp_path, capsys):
    """scripts/bench_fork.py: a line a round with every model.py's rate, then the table (the shipped model the 1.000
    of each ratio, speculation exact for a fork too); a baseline whose model.py fails is one line naming it."""
    import bench_fork
    ckpt, _ = tiny("llama_gqa_tied")
    bench_fork.main(["--checkpoint_path", str(ckpt), "--forks", "rotary", "--repeats", "2", "--eager",
                     "--max_new_tokens", "8"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("round")] == ["round 1", "round 2"]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out if line.startswith("| ")]
    assert [(r[0], r[-1]) for r in rows[1:]] == [("as shipped", "yes"), ("rotary", "yes")]
    assert rows[1][2] == "1.000"
    (tmp_path / "model.py").write_text('raise SystemExit("this model.py refuses to import")\n')
    with pytest.raises(SystemExit, match="as shipped: this model.py refuses to import"):
        bench_fork.main(["--checkpoint_path", str(ckpt), "--forks", "", "--baseline", str(tmp_path), "--repeats", "1",
                         "--eager", "--max_new_tokens", "4"])
