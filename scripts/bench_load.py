"""What a user waits for before the first token: load_model, and the compile of the decode and verify steps, in fresh
processes, per file.

    python scripts/bench_load.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --files bf16,int8,mxfp6

Each cell is one new Python process that imports the project, times `load_model` (the CPU backend's spot checks and
layouts included), then generates a few tokens greedily, plainly and with a verify of K = 7 (n-gram drafts): eager,
or compiled (`--compile`: the decode and the verify step each compiled once) with an empty Inductor cache (cold) and
then with the cache the cold run left (cached), as a second run of the same command finds it. Rows take turns run by
run, so a drifting machine reaches them alike. --repo times another checkout (a commit before a change, say).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from checkpoint import InputError, OneLineErrors, resolve_checkpoint  # noqa: E402
from quantize import MODES  # noqa: E402

ONE_LOAD = """
import json, sys, time
repo, path, compile = sys.argv[1], sys.argv[2], {"compiled": True, "eager": False}[sys.argv[3]]
sys.path.insert(0, repo)
start = time.perf_counter()
import torch
from loading import load_model
from decoding import Steps, generate
from speculative import NgramDrafter
imported = time.perf_counter()
model = load_model(path, "cpu", torch.bfloat16)
loaded = time.perf_counter()
steps = Steps(compile=compile)
prompt = list(range(100, 116)) * 2
generate(model, [prompt], 3, steps)
generate(model, [prompt], 9, steps, drafter=NgramDrafter(), speculate_k=7)
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # what Dynamo compiled: none eager
print(json.dumps(dict(imports=imported - start, load=loaded - imported, steps=time.perf_counter() - loaded,
                      graphs=graphs)))
"""
KINDS = ("eager", "compiled, cold", "compiled, cached")


def one_load(repo, path, kind, cache) -> dict:
    result = subprocess.run([sys.executable, "-c", ONE_LOAD, str(repo), str(path), kind.split(",")[0]],
                            capture_output=True, text=True, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache)))
    if result.returncode:
        raise InputError(f"loading {path} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    times = json.loads(result.stdout.strip().splitlines()[-1])
    if (times["graphs"] > 0) != (kind != "eager"):
        raise InputError(f"{path}: the {kind} run compiled {times['graphs']} graphs")
    return times


def bench_load(opts):
    if opts.runs < 1:
        raise InputError(f"--runs {opts.runs}: must be at least 1")
    ckpt_dir, _ = resolve_checkpoint(opts.checkpoint_path)
    files = {}
    for name in opts.files.split(","):
        if name != "bf16" and name not in MODES:
            raise InputError(f"--files {name}: not a file kind; give bf16 or quantize.py modes ({', '.join(MODES)})")
        files[name] = ckpt_dir / ("model.safetensors" if name == "bf16" else f"model.{name}.safetensors")
        if not files[name].is_file():
            raise InputError(f"--files {name}: {files[name]} not found; make it with quantize.py --mode {name}")
    cells = {(name, kind): [] for name in files for kind in KINDS}
    for _ in range(opts.runs):
        for name, path in files.items():
            with tempfile.TemporaryDirectory() as cache:
                for kind in KINDS:
                    cells[name, kind].append(one_load(opts.repo, path, kind, cache))
    print("seconds before the first tokens of a plain and a speculative (K = 7) request: load_model + the steps' "
          "first run (their compile, compiled)")
    print(f"| file | {' | '.join(KINDS)} | of which load_model |")
    print("|---|---|---|---|---|")
    for name in files:
        spans = [cells[name, kind] for kind in KINDS]
        text = [f"{min(r['load'] + r['steps'] for r in runs):.1f}-{max(r['load'] + r['steps'] for r in runs):.1f} s"
                for runs in spans]
        loads = "/".join(f"{max(r['load'] for r in runs):.1f}" for runs in spans)
        print(f"| {name} | {' | '.join(text)} | {loads} s |")


def main(argv=None):
    p = OneLineErrors(description=__doc__)
    p.add_argument("--checkpoint_path", required=True, help="a checkpoint directory (its quantized files beside)")
    p.add_argument("--files", default="bf16,int8,int4,mxfp6,mxfp4", help="bf16 (model.safetensors) or quantize.py "
                   "modes (model.MODE.safetensors), comma-separated")
    p.add_argument("--runs", type=int, default=2, help="processes per cell")
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout whose load_model is timed")
    cli.run(bench_load, p.parse_args(argv))


if __name__ == "__main__":
    main()
