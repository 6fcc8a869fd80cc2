"""The README's pair command as a user types it: each run a fresh `generate.py` process, plain and speculative taking
turns prompt by prompt, eager and with --compile.

    python scripts/bench_fresh.py --checkpoint_path checkpoints/qwen2.5-coder-1.5b \
        --draft_checkpoint checkpoints/qwen2.5-coder-0.5b --num_prompts 5

Per prompt (the first N HumanEval prompts, or --prompt) and mode, `generate.py --temperature 0 --max_new_tokens N
--json` runs once plainly and once with `--draft_checkpoint D --speculate_k K` (default auto). Reported per mode: the
median decode tok/s of each (what generate.py prints: the tokens after the first over the time after prefill, so
every compile that falls inside the decode is counted), the median of the per-prompt ratios, the seconds before the
first token (load, the draft's load, the warm-up compile, prefill), alpha and drafts a round, and whether the tokens
were the plain run's. --compile runs use Inductor's cache as a second run of the command finds it (the first run of
this script fills it: its first prompt is run once, untimed, before the others).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402

from checkpoint import InputError, OneLineErrors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(args) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True, text=True)
    if result.returncode:
        raise InputError(f"generate.py {' '.join(args[:2])} ... failed: "
                         f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_fresh(opts):
    if opts.num_prompts < 1 or opts.max_new_tokens < 2:
        raise InputError("--num_prompts: at least 1; --max_new_tokens: at least 2")
    prompts = [opts.prompt] if opts.prompt else [t["prompt"] for t in cli.humaneval_tasks(opts.num_prompts)]
    modes = opts.modes.split(",")
    if not set(modes) <= {"eager", "compile"}:
        raise InputError(f"--modes {opts.modes}: eager and/or compile")
    base = ["--checkpoint_path", opts.checkpoint_path, "--temperature", "0", "--max_new_tokens",
            str(opts.max_new_tokens), "--json"]
    spec = ["--draft_checkpoint", opts.draft_checkpoint, "--speculate_k", opts.speculate_k]
    if "compile" in modes:  # Inductor's cache as a user's second run finds it
        run(base + spec + ["--compile", "--prompt", prompts[0]])
        run(base + ["--compile", "--prompt", prompts[0]])
    results = {(mode, kind): [] for mode in modes for kind in ("plain", "spec")}
    for i, prompt in enumerate(prompts):
        print(f"# prompt {i + 1} of {len(prompts)}", file=sys.stderr, flush=True)
        for mode in modes:
            flags = ["--compile"] if mode == "compile" else []
            results[mode, "plain"].append(run(base + flags + ["--prompt", prompt]))
            results[mode, "spec"].append(run(base + spec + flags + ["--prompt", prompt]))
    print(f"| mode | plain tok/s | speculative tok/s | ratio (median; range) | first token s (plain / spec) | alpha | "
          f"drafted a round | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        plain, spec = results[mode, "plain"], results[mode, "spec"]
        ratios = [s["decode_tokens_per_s"] / p["decode_tokens_per_s"] for p, s in zip(plain, spec)]
        first = [statistics.median(r["load_s"] + r.get("draft_load_s", 0) + r["compile_s"] + r["prefill_s"]
                                   for r in runs) for runs in (plain, spec)]
        print(f"| {mode} | {statistics.median(r['decode_tokens_per_s'] for r in plain):.2f} | "
              f"{statistics.median(r['decode_tokens_per_s'] for r in spec):.2f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {first[0]:.1f} / {first[1]:.1f} | "
              f"{statistics.mean(r['alpha'] for r in spec):.3f} | "
              f"{statistics.mean(r['mean_drafted'] for r in spec):.2f} | "
              f"{sum(p['tokens'] == s['tokens'] for p, s in zip(plain, spec))}/{len(prompts)} |", flush=True)


def main(argv=None):
    p = OneLineErrors(description=__doc__)
    p.add_argument("--checkpoint_path", required=True)
    p.add_argument("--draft_checkpoint", required=True)
    p.add_argument("--num_prompts", type=int, default=5, help="the first N HumanEval prompts")
    p.add_argument("--prompt", help="one prompt instead")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--speculate_k", default="auto")
    p.add_argument("--modes", default="eager,compile", help="eager and/or compile")
    cli.run(bench_fresh, p.parse_args(argv))


if __name__ == "__main__":
    main()
