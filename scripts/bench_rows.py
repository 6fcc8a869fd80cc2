"""What a step costs by its rows, per weight format, side by side in one process: the measure that does not drift.

    python scripts/bench_rows.py --checkpoint_path checkpoints/qwen2.5-coder-1.5b --modes bf16,int8,int4,mxfp6

For each format (bf16: the checkpoint itself; a quantize.py mode: its model.MODE.safetensors) the served model takes
one step of 1, 5 and 8 tokens a row (a decode, a verify of K = 4, a verify of K = 7) after a prompt, again and again,
every format and row count taking turns, so that the host's drift reaches them alike. Reported per format and rows:
the median step in ms, the bytes of weights one step reads over that time (GB/s), that as a share of the bf16
decode's (the row the quantized formats are held to), and the step's cost in decode steps of its own format (v).
The roofline: the read bandwidth bench.py measures. A step here is the model's forward of those tokens (compiled with
--compile, as decoding.step compiles it), the products, attention, norms and the LM head together. Before the table,
a line per format says what serves it: how many products run on which kernel and instructions, and whether AMX tiles
did (and why not).
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import backend  # noqa: E402
import quantize  # noqa: E402
from bench import memory_bandwidth_gb_s, quantized_path  # noqa: E402
from checkpoint import InputError, OneLineErrors  # noqa: E402
from loading import DTYPES, load_model  # noqa: E402
from speculative import compile_step  # noqa: E402

PROMPT = 100  # tokens in the cache before the steps


def measure(opts):
    rows = [int(r) for r in opts.rows.split(",")]
    modes = opts.modes.split(",")
    for mode in modes:
        if mode != "bf16" and mode not in quantize.MODES:
            raise InputError(f"--modes: unknown mode '{mode}'; use bf16 or one of {', '.join(quantize.MODES)}")
    if any(r < 1 or r > 32 for r in rows) or opts.repeats < 1:
        raise InputError("--rows: 1 to 32 tokens a row; --repeats: at least 1")
    models, steps = {}, {}
    torch._dynamo.config.recompile_limit = 64  # a graph per format and number of rows
    for mode in modes:
        path = opts.checkpoint_path if mode == "bf16" else quantized_path(opts.checkpoint_path, mode)
        m = load_model(path, "cpu", DTYPES[opts.dtype])
        m.setup_caches(1, PROMPT + 2 * max(rows) + 8)
        with torch.inference_mode():  # as generate runs its steps
            m(torch.arange(PROMPT)[None] % 1000, torch.arange(PROMPT)[None])
        models[mode] = m
        steps[mode] = compile_step(lambda tokens, positions, m=m: m(tokens, positions), "cpu") if opts.compile else m
        print(f"{mode}: {backend.report(m).serves}, {backend.report(m).step_bytes / 1e6:.1f} MB a step", flush=True)
    bandwidth = memory_bandwidth_gb_s()
    times = {(mode, r): [] for mode in modes for r in rows}
    tokens = {r: torch.arange(r)[None] % 1000 + 1000 for r in rows}
    positions = {r: PROMPT + torch.arange(r)[None] for r in rows}
    with torch.inference_mode():
        for repeat in range(opts.repeats + 2):  # the first two warm up
            for mode, step in steps.items():
                for r in rows:
                    start = time.perf_counter()
                    step(tokens[r], positions[r])
                    if repeat >= 2:
                        times[mode, r].append(time.perf_counter() - start)
    print(f"\nread bandwidth (bench.py's probe): {bandwidth:.1f} GB/s; median of {opts.repeats} steps, "
          f"{torch.get_num_threads()} threads, {'compiled' if opts.compile else 'eager'}")
    print("| format | tokens a row | ms | GB/s of weights | of bf16 decode's | v (decode steps) |")
    print("|---|---|---|---|---|---|")
    base = None
    for mode in modes:
        step_bytes = backend.report(models[mode]).step_bytes
        one = statistics.median(times[mode, rows[0]])
        for r in rows:
            t = statistics.median(times[mode, r])
            rate = step_bytes / t / 1e9
            if base is None:
                base = rate
            print(f"| {mode} | {r} | {t * 1e3:.2f} | {rate:.1f} | {rate / base:.0%} | {t / one:.2f} |")


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_path", required=True)
    parser.add_argument("--modes", default="bf16,int8,int4,mxfp6", help="bf16 and quantize.py modes (their files "
                        "beside the checkpoint); the first is the baseline of the GB/s share")
    parser.add_argument("--rows", default="1,5,8", help="tokens a row of each step; the first is the decode")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--compile", action="store_true", help="the steps compiled, as generate.py --compile runs them")
    cli.run(measure, parser.parse_args(argv))


if __name__ == "__main__":
    main()
