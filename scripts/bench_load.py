"""What a user waits for before the first token: load_model in fresh processes, per file and backend.

    python scripts/bench_load.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --files bf16,int8,mxfp6

Each cell is one new Python process that imports the project and times `load_model` and then one forward (the
first token's prefill): the cell is their sum. `auto, first` runs with an empty verdict cache (the CPU backend checks
itself), `auto, later` with the cache the first run left. Rows take turns run by run, so a drifting machine reaches
them alike.
--repo times another checkout's load_model (a commit before a change, say) on the same files.
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
repo, path, backend = sys.argv[1:4]
sys.path.insert(0, repo)
start = time.perf_counter()
import torch
from loading import load_model
imported = time.perf_counter()
model = load_model(path, "cpu", torch.bfloat16, backend=backend)
loaded = time.perf_counter()
with torch.no_grad():
    model.setup_caches(1, 64)
    model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
print(json.dumps(dict(imports=imported - start, load=loaded - imported, first_forward=time.perf_counter() - loaded)))
"""


def one_load(repo, path, backend, cache) -> dict:
    result = subprocess.run([sys.executable, "-c", ONE_LOAD, str(repo), str(path), backend], capture_output=True,
                            text=True, env=dict(os.environ, FASTDECODE_CACHE=str(cache)))
    if result.returncode:
        raise InputError(f"loading {path} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    cells = {(name, kind): [] for name in files for kind in ("torch", "auto, first", "auto, later")}
    for _ in range(opts.runs):
        for name, path in files.items():
            with tempfile.TemporaryDirectory() as cache:
                cells[name, "torch"].append(one_load(opts.repo, path, "torch", cache))
                cells[name, "auto, first"].append(one_load(opts.repo, path, "auto", cache))
                cells[name, "auto, later"].append(one_load(opts.repo, path, "auto", cache))
    print("load_model, then the first forward (3 tokens), seconds: what a user waits for before a first token")
    kinds = " | ".join(("torch", "auto, first", "auto, later"))
    print(f"| file | {kinds} | of which the first forward |")
    print("|---|---|---|---|---|")
    for name in files:
        spans = [cells[name, kind] for kind in ("torch", "auto, first", "auto, later")]
        totals = [[r["load"] + r["first_forward"] for r in runs] for runs in spans]
        text = [f"{min(t):.2f}-{max(t):.2f} s" for t in totals]
        forwards = "/".join(f"{max(r['first_forward'] for r in runs):.2f}" for runs in spans)
        print(f"| {name} | {' | '.join(text)} | {forwards} s |")


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
