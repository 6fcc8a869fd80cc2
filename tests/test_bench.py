"""scripts/bench.py: its errors, and the idle / busy table of --contended."""
from test_generate import assert_one_line_error, cli


def test_bench_errors_are_one_line(smollm2, tmp_path):
    ckpt, _ = smollm2
    assert_one_line_error(cli("--checkpoint_path", str(tmp_path / "nope"), script="scripts/bench.py"), "nope",
                          "not found")
    # an unknown mode names the ones there are, not a quantize.py command that would fail too
    result = cli("--checkpoint_path", str(ckpt), "--rows", "compiled,quant-int3", script="scripts/bench.py")
    assert_one_line_error(result, "quant-int3", "int8, int4, mxfp8")
    assert "quantize.py" not in result.stderr
    assert_one_line_error(cli("--checkpoint_path", str(ckpt), "--rows", "compiled,spec-ngram-33",
                              script="scripts/bench.py"), "spec-ngram-33", "at most 32")


def test_contended_reports_idle_and_busy_side_by_side(smollm2):
    ckpt, _ = smollm2
    result = cli("--checkpoint_path", str(ckpt), "--rows", "compiled,spec-ngram-4", "--num_prompts", "1", "--runs",
                 "1", "--max_new_tokens", "16", "--contended", script="scripts/bench.py")
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert "idle tok/s" in table[0] and "busy tok/s" in table[0] and "busy / idle" in table[0]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["ours, compiled", "spec-ngram-4"]
