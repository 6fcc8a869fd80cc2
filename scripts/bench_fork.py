"""What a fork's edit to model.py costs on the CPU backend, side by side in one process.

    python scripts/bench_fork.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct

Three models from one checkpoint: model.py as shipped, and two forks as a user would make them, each edited in the
source of one function: the MLP's activation (SiLU -> GELU, model.FeedForward.forward) and attention's scale (x 0.9,
model.Attention.attend). The backend serves each with what its kernels still implement (the edited function runs
as model.py's code: docs/how-it-works.md, "A fork keeps its speed"). They decode the same prompt greedily, taking
turns, so the host's drift reaches them alike; reported: each one's median decode tok/s and its share of the
unedited model's, and whether speculation (n-gram drafts, K = 4) gave its plain tokens.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import contextlib  # noqa: E402
import inspect  # noqa: E402
import linecache  # noqa: E402
import statistics  # noqa: E402
import textwrap  # noqa: E402

import torch  # noqa: E402

import backend  # noqa: E402
import model  # noqa: E402
from checkpoint import OneLineErrors, resolve_checkpoint  # noqa: E402
from decoding import Steps, generate  # noqa: E402
from loading import DTYPES, load_model  # noqa: E402
from speculative import NgramDrafter  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

# (name, the function edited, the text replaced, what replaces it)
EDITS = [("activation", model.FeedForward, "forward", "F.silu(self.w1(x))", "F.gelu(self.w1(x), approximate=\"tanh\")"),
         ("attention scale", model.Attention, "attend", "attn_mask=mask)",
          "attn_mask=mask, scale=0.9 / q.shape[-1] ** 0.5)")]


def edited(owner, name, old, new):
    """The function a fork's model.py would define with `old` replaced by `new` in `owner.name`'s source (its source
    readable, as the backend's fingerprints read it)."""
    source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
    assert old in source, f"{owner.__name__}.{name} no longer holds {old!r}"
    source = source.replace(old, new)
    filename = f"<fork of model.py: {owner.__name__}.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {}
    exec(compile(source, filename, "exec"), vars(model), namespace)
    return namespace[name]


@contextlib.contextmanager
def fork(edit):
    """model.py as the fork has it, while the block runs (None: as shipped)."""
    if edit is None:
        yield
        return
    owner, name, function = edit
    shipped = getattr(owner, name)
    setattr(owner, name, function)
    try:
        yield
    finally:
        setattr(owner, name, shipped)


def measure(opts):
    ckpt_dir, _ = resolve_checkpoint(opts.checkpoint_path)
    prompt = Tokenizer(ckpt_dir).encode(opts.prompt)
    forks = {"as shipped": None}
    forks.update({label: (owner, name, edited(owner, name, old, new)) for label, owner, name, old, new in EDITS})
    models = {}
    for label, edit in forks.items():
        with fork(edit):
            models[label] = load_model(opts.checkpoint_path, "cpu", DTYPES[opts.dtype])
        print(f"{label}: {backend.report(models[label]).serves}", flush=True)
    rates = {label: [] for label in forks}
    exact = {}
    steps = Steps()
    for repeat in range(opts.repeats + 1):  # the first warms up
        for label, edit in forks.items():
            with fork(edit), torch.no_grad():
                rows, stats = generate(models[label], [prompt], opts.max_new_tokens, steps)
                if repeat == 0:
                    drafted, _ = generate(models[label], [prompt], opts.max_new_tokens, steps,
                                          drafter=NgramDrafter(), speculate_k=4)
                    exact[label] = drafted == rows
                else:
                    rates[label].append((len(rows[0]) - 1) / (stats["total_s"] - stats["prefill_s"]))
    base = statistics.median(rates["as shipped"])
    print("| model.py | decode tok/s | x as shipped | speculation exact |\n|---|---|---|---|")
    for label in forks:
        rate = statistics.median(rates[label])
        print(f"| {label} | {rate:.1f} | {rate / base:.2f} | {'yes' if exact[label] else 'NO'} |")


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_path", default="checkpoints/SmolLM2-135M-Instruct")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    cli.run(measure, parser.parse_args(argv))


if __name__ == "__main__":
    main()
