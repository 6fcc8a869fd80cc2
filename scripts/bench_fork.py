"""What a fork's edit to model.py costs, on the CPU backend with --compile: the shipped model and four forks as a user
would make them, each edited in the source of one function of model.py, decoded in turns by long-lived processes.

    python scripts/bench_fork.py --checkpoint_path checkpoints/qwen2.5-coder-1.5b

The forks: RMSNorm's eps (x 10, model.RMSNorm.forward), the MLP's activation (SiLU -> GELU, model.FeedForward.forward),
rotary (the other direction, model.apply_rotary) and attention's scale (x 0.9, model.Attention.attend). Each is plain
Python that the compiled step runs around the same kernels. A process per model.py (Dynamo does not guard on a
class's methods, so a step compiled for one model.py would run for another in the same process), all alive at once
(memory for each): each loads the checkpoint, compiles, checks that speculation (n-gram drafts, K = 4) gives the plain
tokens, then decodes the prompt greedily once a round, the processes taking turns round by round. Reported: each one's
median decode tok/s, its share of the shipped model's (the median and range over the rounds of its rate over the
shipped model's in the same round: a VM's speed drifts between rounds), and whether speculation was exact.
--baseline CHECKOUT adds its model.py as shipped (a commit before a change, say) to the turns; --forks picks the
forks (none: the shipped model against the baseline); --eager decodes without --compile.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from checkpoint import InputError, OneLineErrors, resolve_checkpoint  # noqa: E402

# (name, the function edited, the text replaced, what replaces it)
EDITS = {"as shipped": None,
         "RMSNorm eps": ("RMSNorm.forward", "self.weight, self.eps)", "self.weight, self.eps * 10)"),
         "activation": ("FeedForward.forward", "self.gate(gate)", "F.gelu(gate, approximate=\"tanh\")"),
         "rotary": ("apply_rotary", "x1 * cos - x2 * sin, x2 * cos + x1 * sin", "x1 * cos + x2 * sin, x2 * cos - x1 * sin"),
         "attention scale": ("Attention.attend", "visible, self.scale)", "visible, 0.9 * self.scale)")}

SERVER = """
import inspect, json, sys, textwrap, time
root, checkpoint, edit, prompt, new_tokens, dtype, compiled = sys.argv[1:]
sys.path.insert(0, root)
import torch
import model
edit = json.loads(edit)
if edit:  # the function as a fork's model.py defines it
    name, old, new = edit
    owner, _, attribute = name.rpartition(".")
    target = getattr(model, owner) if owner else model
    source = textwrap.dedent(inspect.getsource(getattr(target, attribute)))
    assert old in source, f"model.{name} no longer holds {old!r}"
    namespace = {}
    exec(compile(source.replace(old, new), f"<fork of model.{name}>", "exec"), vars(model), namespace)
    setattr(target, attribute, namespace[attribute])
from checkpoint import resolve_checkpoint
from decoding import Steps, generate
from loading import DTYPES, load_model
from speculative import NgramDrafter
from tokenizer import Tokenizer
m = load_model(checkpoint, "cpu", DTYPES[dtype])
ids = Tokenizer(resolve_checkpoint(checkpoint)[0]).encode(prompt)
steps = Steps(compile=compiled == "1")
rows, _ = generate(m, [ids], int(new_tokens), steps)
drafted, _ = generate(m, [ids], int(new_tokens), steps, drafter=NgramDrafter(), speculate_k=4)
print(json.dumps(dict(exact=drafted == rows)), flush=True)
for _ in sys.stdin:  # a line a round
    rows, stats = generate(m, [ids], int(new_tokens), steps)
    print((len(rows[0]) - 1) / (stats["total_s"] - stats["prefill_s"]), flush=True)
"""


def ready(label, server, log) -> str:
    """The server's next line, or the last line of its log (stderr) as an InputError."""
    line = server.stdout.readline()
    if not line:
        server.wait()
        log.seek(0)
        raise InputError(f"{label}: {(log.read().strip().splitlines() or ['?'])[-1]}")
    return line.strip()


def measure(opts):
    resolve_checkpoint(opts.checkpoint_path)
    if opts.repeats < 1:
        raise InputError(f"--repeats {opts.repeats}: must be at least 1")
    root = Path(__file__).resolve().parent.parent
    runs = {"as shipped": (root, None)}
    for name in filter(None, opts.forks.split(",")):
        if name not in EDITS or EDITS[name] is None:
            raise InputError(f"--forks {name}: not a fork; give some of {', '.join(list(EDITS)[1:])}")
        runs[name] = (root, EDITS[name])
    if opts.baseline:
        if not (Path(opts.baseline) / "model.py").is_file():
            raise InputError(f"--baseline {opts.baseline}: no model.py there; give a checkout of this project")
        runs[f"{opts.baseline} as shipped"] = (Path(opts.baseline).resolve(), None)
    servers, logs, exact = {}, {}, {}
    try:
        for label, (checkout, edit) in runs.items():  # one after another: the loads and compiles do not overlap
            logs[label] = tempfile.TemporaryFile("w+")
            servers[label] = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(checkout), opts.checkpoint_path, json.dumps(edit), opts.prompt,
                 str(opts.max_new_tokens), opts.dtype, "0" if opts.eager else "1"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[label], text=True)
            exact[label] = json.loads(ready(label, servers[label], logs[label]))["exact"]
        rates = {label: [] for label in runs}
        for round_ in range(opts.repeats):
            for label, server in servers.items():
                server.stdin.write("go\n")
                server.stdin.flush()
                rates[label].append(float(ready(label, server, logs[label])))
            print(f"round {round_ + 1}: " + ", ".join(f"{label} {r[-1]:.2f}" for label, r in rates.items()), flush=True)
    finally:
        for server in servers.values():
            server.kill()
        for log in logs.values():
            log.close()
    print("| model.py | decode tok/s (median) | x as shipped (median) | x as shipped, by round | speculation exact |\n"
          "|---|---|---|---|---|")
    for label in runs:
        ratios = [rate / shipped for rate, shipped in zip(rates[label], rates["as shipped"])]
        print(f"| {label} | {statistics.median(rates[label]):.2f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.2f}-{max(ratios):.2f} | {'yes' if exact[label] else 'NO'} |")


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_path", default="checkpoints/SmolLM2-135M-Instruct")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="rounds: a decode of each model.py, taking turns")
    parser.add_argument("--eager", action="store_true", help="decode without --compile")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--forks", default=",".join(list(EDITS)[1:]), help="which forks, comma-separated (empty: none)")
    parser.add_argument("--baseline", help="another checkout whose model.py as shipped takes turns too")
    cli.run(measure, parser.parse_args(argv))


if __name__ == "__main__":
    main()
