"""Decode speed, side by side in one process, on the first N HumanEval prompts.

    python scripts/bench.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --dtype bf16

Rows: this project's compiled decode (model.py's forward compiled around the backend's kernels; its "compile s" is
the cold compile, timed with an empty Inductor cache), its eager decode, and `transformers`' generate on the same
weights;
quant-MODE rows run the checkpoint's quantized files (quantize.py), llama.cpp runs a GGUF when llama-cpp-python
is installed, spec-* rows speculate (spec-MODE: the target drafted by its own quantized file; spec-draft: by
--draft_checkpoint, another model; spec-draft.MODE: by the draft's quantized file), and quant-MODE+spec-* rows
speculate on the quantized target. A speculative row's "same tokens" counts the prompts where it gave its target's
plain output (the quant-MODE row's for a quantized target); every other row's, the first row's output.

The pair (docs/performance.md):

    python scripts/bench.py --checkpoint_path checkpoints/qwen2.5-coder-1.5b \
        --draft_checkpoint checkpoints/qwen2.5-coder-0.5b --num_prompts 10 --runs 1 \
        --rows compiled,quant-int8,spec-draft-4,spec-draft.int4-4,quant-mxfp6+spec-draft.int4-4,hf,hf-draft
Every row is set up first, with a warm-up (for compiled rows the cold compile, timed with an empty inductor
cache). Then the rows take turns: for each prompt and each of --runs runs, every row generates exactly
--max_new_tokens tokens (EOS ignored; --stop_at_eos: our rows stop at the checkpoint's EOS, as generate.py and
serve.py do), so a shared machine's drift reaches all rows alike and the ratios hold better than the absolute speed.
Reported: decode tok/s (median; prefill excluded), bytes of weights read per token x tok/s as % of the memory bandwidth this script measures itself (the most its probe read, before the rows and
after each prompt), the ratio of medians to the first row, and the range of the ratios turn by turn (how far the
rows drift apart within the run).

--random_weights CONFIG runs a model of that config.json's shapes with random weights (no checkpoint needed: a
Llama-2-7B-shaped target on a GPU, say), on random prompts; its quant-MODE rows quantize it in memory and its
spec-self-K / spec-MODE-K rows draft with a copy of it (every draft accepted: the verify cost v and the draft cost c
are real); spec-random-K rows draft with a random model of --draft_config's shapes (c and v real, nothing accepted).
--device cuda runs the rows on the GPU (the compiled steps with CUDA graphs). The GPU run: docs/cuda.md.

--contended runs every turn twice, on the idle machine and beside a busy process (a Python busy loop, started for
the turn and stopped after it), and reports both speeds side by side: what a shared machine does to each row.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import atexit  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_export import to_hf_model  # noqa: E402
import quantize  # noqa: E402
from checkpoint import InputError, OneLineErrors, read_model_args, resolve_checkpoint  # noqa: E402
import backend  # noqa: E402
import cpu  # noqa: E402
from decoding import Steps, generate, plan, presize_caches  # noqa: E402
from loading import (DRAFT_VOCAB, DTYPES, apply_backend, check_device, draft_vocabulary, load_model,  # noqa: E402
                     make_drafter)
from model import ModelArgs, Transformer  # noqa: E402
from cli import humaneval_tasks  # noqa: E402
from speculative import ModelDrafter, expected_speedup  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def memory_bandwidth_gb_s(size_mb: int = 1024, repeats: int = 5, device="cpu") -> float:
    """Read bandwidth: the best of several full reads of a buffer much larger than the caches, by a reduction and, on
    CPU, as the kernels read weights (few_rows' stream_read: huge pages, every core, 64-byte loads, their prefetch).
    A reduction alone measured less than the bf16 decode read on Zen 4 (34.0 against 39.9 GB/s); stream_read less
    than a reduction on Zen 1 (19-20 against 21-22)."""
    nbytes = size_mb * 2**20
    reads = [(torch.ones(nbytes // 4, dtype=torch.float32, device=device), torch.Tensor.sum)]
    if device == "cpu" and cpu.kernels.load():
        from cpu.huge_pages import huge_page_memory
        reads.append((huge_page_memory(nbytes).fill_(1), torch.ops.few_rows.stream_read))
    best = float("inf")
    for buffer, read in reads:
        read(buffer)
        for _ in range(repeats):
            synchronize(device)
            t = time.perf_counter()
            read(buffer)
            synchronize(device)
            best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def ours(model, prompts, new_tokens, compiled, drafter=None, k=4, eos_ids=()):
    """Warm up (compiled: the compile) and return (seconds it took, run); run(i) generates for prompt i and
    returns (decode tok/s: emitted tokens after the first over the time after prefill, tokens, stats)."""
    steps = Steps(compile=compiled, device=model.tok_embeddings.weight.device)
    spec = dict(drafter=drafter, speculate_k=k)
    presize_caches(model, 1, plan(model.args, max(map(len, prompts)), new_tokens, k if drafter else None))  # the
    # compiled shapes are final
    t = time.perf_counter()
    generate(model, prompts[:1], 12 if drafter else 3, steps, **spec)
    warmup_s = time.perf_counter() - t

    def run(i):
        rows, stats = generate(model, [prompts[i]], new_tokens, steps, eos_ids=eos_ids, **spec)
        return (len(rows[0]) - 1) / (stats["total_s"] - stats["prefill_s"]), rows[0], stats
    return warmup_s, run


def random_model(config, device, dtype, mode=None, backend="auto"):
    """A model of config.json's shapes with random weights (seeded: every call gives the same model), quantized in
    memory to mode, with the backend its device has."""
    args = read_model_args(config)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)  # in its dtype before it has memory: never a float32 copy (27 GB at 7B)
    model = model.to_empty(device=device).eval()
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1) if "norm" in name and name.endswith("weight") else p.normal_(0, 0.02, generator=g)
    model.tie_weights()
    if mode:
        quantize.quantize_model(model, mode)
    if backend != "torch":
        apply_backend(model, name=backend)
    return model


def load_row_model(opts, mode=None):
    """The target (mode None) or its quantized copy, from the checkpoint or (--random_weights) made up.
    Each is loaded once: the rows of one target share its weights."""
    if mode not in LOADED:
        LOADED[mode] = load_target(opts, mode)
    return LOADED[mode]


LOADED = {}  # target mode (None: the checkpoint itself) or draft row kind -> model


def load_target(opts, mode):
    if opts.random_weights:
        return random_model(opts.random_weights, opts.device, DTYPES[opts.dtype], mode, opts.backend)
    path = quantized_path(opts.checkpoint_path, mode) if mode else opts.checkpoint_path
    return load_model(path, opts.device, DTYPES[opts.dtype], backend=opts.backend)


def quantized_path(checkpoint_path, mode):
    path = resolve_checkpoint(checkpoint_path)[0] / f"model.{mode}.safetensors"
    if not path.is_file():
        raise InputError(f"{path} not found; run: python quantize.py --checkpoint_path {checkpoint_path} "
                         f"--mode {mode}")
    return path


DRAFTERS = ("self", "random", "ngram", "draft", *quantize.MODES, *(f"draft.{mode}" for mode in quantize.MODES))


def split_row(row, default_k):
    """quant-MODE+spec-DRAFTER-K -> (target mode or None, drafter or None, K or None)."""
    mode, spec = None, row
    if row.startswith("quant-"):
        mode, _, spec = row[6:].partition("+")
    if not spec.startswith("spec-"):
        return mode, None, None
    drafter, _, k = spec[5:].partition("-")
    k = k or default_k
    return mode, drafter, k if k == "auto" else int(k)


def draft_path(opts, drafter):
    """The draft row's file: --draft_checkpoint, or (draft.MODE) its quantize.py file."""
    return quantized_path(opts.draft_checkpoint, drafter[6:]) if "." in drafter else opts.draft_checkpoint


def drafter_vocab(drafter):
    """DRAFTER[:V] -> (drafter, the tokens its LM head keeps: V, all (None), or by default generate.py's for a draft
    model and all for self, the target itself)."""
    drafter, _, vocab = drafter.partition(":")
    if vocab:
        return drafter, None if vocab == "all" else int(vocab)
    return drafter, None if drafter in ("self", "random", "ngram") else DRAFT_VOCAB


def check_rows(rows, opts):
    """Every --rows entry is known and its files exist before anything loads."""
    if bool(opts.checkpoint_path) == bool(opts.random_weights):
        raise InputError("give --checkpoint_path or --random_weights CONFIG (one of them)")
    for name in ("num_prompts", "runs", "max_new_tokens"):
        if getattr(opts, name) < 1:
            raise InputError(f"--{name} {getattr(opts, name)}: must be at least 1")
    if not opts.random_weights and opts.num_prompts > 164:
        raise InputError(f"--num_prompts {opts.num_prompts}: HumanEval has 164 prompts")
    if opts.stop_at_eos and opts.random_weights:
        raise InputError("--stop_at_eos: random weights have no EOS; drop it with --random_weights")
    if opts.gguf and not Path(opts.gguf).is_file():
        raise InputError(f"--gguf {opts.gguf}: not found")
    check_device(opts.device)
    for config in (opts.random_weights, opts.draft_config):
        if config:
            read_model_args(Path(config))
    for row in rows:
        if row == "hf-draft" and not opts.draft_checkpoint:
            raise InputError("--rows hf-draft: needs --draft_checkpoint PATH")
        if opts.stop_at_eos and row in ("hf", "hf-draft", "llama.cpp"):
            raise InputError(f"--rows {row}: generates exactly --max_new_tokens; drop it with --stop_at_eos")
        if opts.random_weights and row in ("hf", "hf-draft", "llama.cpp"):
            raise InputError(f"--rows {row}: needs real weights; drop it with --random_weights")
        if opts.device != "cpu" and row == "llama.cpp":
            raise InputError(f"--rows llama.cpp runs on the CPU; drop it with --device {opts.device}")
        mode, drafter, _ = split_row(row, "1") if row.startswith(("quant-", "spec-")) else (None, None, None)
        if mode is not None:
            if mode not in quantize.MODES:
                raise InputError(f"--rows {row}: unknown mode '{mode}'; use quant-MODE with MODE one of "
                                 f"{', '.join(quantize.MODES)}")
            if not opts.random_weights:
                quantized_path(opts.checkpoint_path, mode)
        if row.startswith("spec-") or "+" in row:
            spec = row.partition("+")[2] if "+" in row else row
            if not spec.startswith("spec-"):
                raise InputError(f"--rows {row}: after '+' comes a speculative row, spec-DRAFTER[-K]")
            drafter, _, k = spec[5:].partition("-")
            drafter, _, vocab = drafter.partition(":")
            if vocab and (drafter in ("random", "ngram") or not (vocab == "all" or vocab.isdigit() and int(vocab) >= 16
                                                                 and int(vocab) % 16 == 0)):
                raise InputError(f"--rows {row}: ':{vocab}' must be ':all' or a multiple of 16 (the draft's LM head "
                                 "rows), after a model drafter")
            if drafter not in DRAFTERS:
                raise InputError(f"--rows {row}: unknown drafter '{drafter}'; use self, random, ngram, draft, "
                                 "draft.MODE or MODE (MODE a quantize.py mode)")
            k = k or opts.speculate_k
            limit = backend.LONGEST_VERIFY  # a backend may lower it: the rows then say so
            if k != "auto" and not (k.isdigit() and int(k) >= 1 and (limit is None or int(k) < limit)):
                raise InputError(f"--rows {row}: K '{k}' must be auto or an integer, at least 1"
                                 + (f" and at most {limit - 1}" if limit else ""))
            if drafter in quantize.MODES and not opts.random_weights:
                quantized_path(opts.checkpoint_path, drafter)
            if drafter.startswith("draft"):
                if not opts.draft_checkpoint:
                    raise InputError(f"--rows {row}: needs --draft_checkpoint PATH")
                resolve_checkpoint(opts.draft_checkpoint)
                draft_path(opts, drafter)
        if row.startswith(("quant-", "spec-")):
            continue
        if row == "llama.cpp" and not opts.gguf:
            raise InputError("--rows llama.cpp needs --gguf PATH")
        elif row not in ("compiled", "eager", "hf", "hf-draft", "llama.cpp"):
            raise InputError(f"--rows: unknown row '{row}'; use compiled, eager, hf, hf-draft, quant-MODE, llama.cpp, "
                             "spec-DRAFTER[-K], quant-MODE+spec-DRAFTER[-K]")


def row_drafter(kind, opts, vocab_size, compiled):
    kind, vocab = drafter_vocab(kind)
    if kind.startswith("draft") or kind in quantize.MODES or kind == "self":
        # a model of its own (never the target's object: a draft's cache is its own), shared by the rows it drafts
        if f"drafter {kind}:{vocab}" not in LOADED:
            LOADED[f"drafter {kind}:{vocab}"] = load_drafter_model(kind, opts, vocab)
        model, vocabulary = LOADED[f"drafter {kind}:{vocab}"]
        return ModelDrafter(model, compile=compiled, vocabulary=vocabulary)
    if kind == "ngram":
        return make_drafter("ngram")
    # random: a random-weight draft of the same vocabulary (--draft_config's shapes): almost nothing is accepted,
    # but the draft's cost c and the verify's v are real
    torch.manual_seed(0)
    args = read_model_args(opts.draft_config) if opts.draft_config else \
        ModelArgs(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                  max_seq_len=8192)
    if args.vocab_size != vocab_size:
        raise InputError(f"{opts.draft_config}: vocab_size {args.vocab_size}, the target's is {vocab_size}")
    with torch.device(opts.device):
        draft = Transformer(args).to(DTYPES[opts.dtype]).eval()
    return ModelDrafter(draft, compile=compiled)


def load_drafter_model(kind, opts, vocab):
    """-> (the draft model, the token ids its LM head keeps or None)."""
    if kind.startswith("draft"):  # another model of the same vocabulary: --draft_checkpoint (or its quantized file)
        vocabulary = draft_vocabulary(opts.draft_checkpoint, vocab)
        model = load_model(draft_path(opts, kind), opts.device, DTYPES[opts.dtype], backend=opts.backend,
                           head_rows=vocabulary)
        return model, vocabulary
    # MODE: a quantized copy of the target, lossless speculation without a second model; self: the target itself,
    # everything accepted (measures the overhead); random weights: every token
    vocabulary = None if opts.random_weights else draft_vocabulary(opts.checkpoint_path, vocab)
    mode = None if kind == "self" else kind
    if opts.random_weights:
        return load_target(opts, mode), None
    path = quantized_path(opts.checkpoint_path, mode) if mode else opts.checkpoint_path
    model = load_model(path, opts.device, DTYPES[opts.dtype], backend=opts.backend, head_rows=vocabulary)
    return model, vocabulary


def llama_cpp(gguf, texts, new_tokens):
    """llama.cpp (llama-cpp-python) greedy decode on the same prompts, 2 threads, one token per eval."""
    import llama_cpp as lc
    llm = lc.Llama(str(gguf), n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)

    def decode(text, n):
        llm.reset()
        llm.eval(llm.tokenize(text.encode()))
        t, out = time.perf_counter(), []
        for _ in range(n):
            out.append(llm.sample(temp=0.0))
            llm.eval([out[-1]])
        return n / (time.perf_counter() - t), out, {}

    t = time.perf_counter()
    decode(texts[0], 3)
    return time.perf_counter() - t, lambda i: decode(texts[i], new_tokens)


def hf_generate(hf, prompts, new_tokens, assistant=None):
    """transformers' generate, greedy; with an assistant model, its assisted generation (speculative decoding)."""
    for model in (hf, assistant) if assistant is not None else (hf,):
        model.generation_config.eos_token_id = None  # like our rows: exactly n tokens, EOS is not special
    extra = dict(assistant_model=assistant) if assistant is not None else {}

    @torch.no_grad()
    def timed(prompt, n):
        t = time.perf_counter()
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    def run(i):
        prefill_s, _ = timed(prompts[i], 1)
        total_s, tokens = timed(prompts[i], new_tokens)
        return (new_tokens - 1) / (total_s - prefill_s), tokens, {}

    t = time.perf_counter()
    timed(prompts[0], 3)
    return time.perf_counter() - t, run


class BusyProcess:
    """A Python busy loop in another process while the context lasts: another program keeping one core busy."""

    def __enter__(self):
        # it spins until its parent is gone: a killed bench leaves no busy loop behind
        spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(10**6): pass"
        self.process = subprocess.Popen([sys.executable, "-c", spin])
        time.sleep(0.3)  # started and spinning
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


def set_up(rows, opts, model, prompts, step_bytes):
    """Per row: [name, bytes a step reads, warm-up seconds, run, whether compiled, the row its tokens must equal,
    bytes a draft step reads (0: no draft model)]."""
    by_target = {}  # the spec rows' K per target: its cache sized once for every row that shares it
    for row in rows:
        mode, drafter, k = split_row(row, opts.speculate_k) if row.startswith(("quant-", "spec-")) else (0, 0, 0)
        if drafter:
            by_target.setdefault(mode, []).append(k)
    for mode, ks in by_target.items():  # (a new size would recompile the rows compiled before it)
        target = load_row_model(opts, mode)
        presize_caches(target, 1, plan(target.args, max(map(len, prompts)), opts.max_new_tokens,
                                       "auto" if "auto" in ks else max(ks)))
    setups, plain_rows = [], {}
    for row in rows:
        row_bytes, compiled, target_row, draft_bytes = step_bytes, True, False, 0
        mode, drafter, k = split_row(row, opts.speculate_k) if row.startswith(("quant-", "spec-")) else (0, 0, 0)
        if drafter:  # spec-DRAFTER-K or quant-MODE+spec-DRAFTER-K
            compiled = not opts.eager_spec
            target = load_row_model(opts, mode)
            row_bytes = backend.report(target).step_bytes
            spec = row_drafter(drafter, opts, model.args.vocab_size, compiled)
            draft_bytes = backend.report(spec.model).step_bytes if isinstance(spec, ModelDrafter) else 0
            warm, run = ours(target, prompts, opts.max_new_tokens, compiled, spec, k, opts.eos_ids)
            target_row = mode
        elif row.startswith("quant-"):
            quantized = load_row_model(opts, mode)
            row_bytes = backend.report(quantized).step_bytes
            warm, run = ours(quantized, prompts, opts.max_new_tokens, compiled=True, eos_ids=opts.eos_ids)
            plain_rows.setdefault(mode, len(setups))
        elif row == "llama.cpp":
            texts = [task["prompt"] for task in humaneval_tasks(opts.num_prompts)]
            warm, run = llama_cpp(opts.gguf, texts, opts.max_new_tokens)
            row_bytes = Path(opts.gguf).stat().st_size
        elif row in ("compiled", "eager"):
            compiled = row == "compiled"
            warm, run = ours(model, prompts, opts.max_new_tokens, compiled=compiled, eos_ids=opts.eos_ids)
        elif row in ("hf", "hf-draft"):
            assistant = None if row == "hf" else to_hf_model(load_model(opts.draft_checkpoint, opts.device,
                                                                        DTYPES[opts.dtype], backend="torch"))
            warm, run = hf_generate(to_hf_model(model), prompts, opts.max_new_tokens, assistant)
            compiled = False
        if row in ("compiled", "eager"):
            plain_rows.setdefault(None, len(setups))
        name = {"compiled": "ours, compiled", "eager": "ours, eager", "hf": "transformers generate",
                "hf-draft": "transformers assisted"}.get(row, row)
        setups.append([name, row_bytes, warm, run, compiled, target_row, draft_bytes])
        print(f"# set up {name} ({warm:.1f} s)", file=sys.stderr, flush=True)
    for setup in setups:  # the row whose tokens this row's must equal: its target's plain row, else the first
        setup[5] = plain_rows.get(setup[5]) if setup[5] is not False else 0
    return setups


def timed_turns(setups, n_prompts, runs, contended=False, after_each_prompt=None):
    """For each prompt and run, every row once: per row, a list of (decode tok/s, tokens, stats). Contended: each
    such turn runs on the idle machine, then again beside a busy process; returns (idle, busy). after_each_prompt()
    runs after each prompt's turns."""
    loads = (False, True) if contended else (False,)
    results = {busy: [[] for _ in setups] for busy in loads}
    for i in range(n_prompts):
        print(f"# turn {i + 1} of {n_prompts}: prompt {i}, every row{f' x {runs} runs' if runs > 1 else ''}",
              file=sys.stderr, flush=True)
        for _ in range(runs):
            for busy in loads:  # idle and busy turns alternate, so a drifting machine reaches both alike
                with BusyProcess() if busy else contextlib.nullcontext():
                    turn = [setup[3](i) for setup in setups]
                for j, result in enumerate(turn):
                    results[busy][j].append(result)
        if after_each_prompt:
            after_each_prompt()
    return tuple(results[busy] for busy in loads)


def same_tokens(results, j, runs, baseline=0, also=None) -> str:
    """'same/prompts' against the baseline row (the fewer of results and also); '-' where the row's target has no
    plain row to compare with."""
    if baseline is None:
        return "-"
    same = min(sum(a[1] == b[1] for a, b in zip(r[j][::runs], r[baseline][::runs])) for r in (results, also or results))
    return f"{same}/{len(results[0]) // runs}"


def print_table(setups, results, bandwidth, runs):
    w = max(24, *(len(setup[0]) for setup in setups))
    rates = [[rate for rate, _, _ in row] for row in results]
    first = statistics.median(rates[0])
    # Each turn (a prompt and a run) times every row within seconds: its ratios show the drift the median hides.
    print(f"| {'row':<{w}} | {'tok/s':>7} | {'GB/s':>6} | {'% bandwidth':>11} | {'vs first':>8} | {'per turn':>11} | "
          f"{'compile s':>9} | same tokens |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 8}|{'-' * 13}|{'-' * 10}|{'-' * 13}|{'-' * 11}|-------------|")
    spec_lines = []
    for j, (name, row_bytes, warm, _, compiled, baseline, draft_bytes) in enumerate(setups):
        rate = statistics.median(rates[j])
        compile_s = f"{warm:.1f}" if compiled else "-"
        turns = [a / b for a, b in zip(rates[j], rates[0])]
        print(f"| {name:<{w}} | {rate:7.2f} | {row_bytes * rate / 1e9:6.1f} | {100 * row_bytes * rate / 1e9 / bandwidth:10.1f}% | "
              f"{rate / first:7.2f}x | {f'{min(turns):.2f}-{max(turns):.2f}x':>11} | {compile_s:>9} | "
              f"{same_tokens(results, j, runs, baseline):>11} |", flush=True)
        stats = [s for _, _, s in results[j]]
        if "alpha" in stats[0]:
            alpha, c, drafted, emitted, draft_ms = (statistics.mean(s[key] for s in stats) for key in (
                "alpha", "draft_cost_ratio", "mean_drafted", "mean_accepted", "draft_step_s"))
            k = stats[0]["speculate_k"]
            predicted = expected_speedup(alpha, c, drafted)  # (for auto: at its mean length)
            # v: one verify round in plain decode steps of the first row
            verify_cost = statistics.mean(s["verify_s_per_round"] for s in stats) * first
            draft_mb = f"{draft_bytes / 1e6:8.1f}" if draft_bytes else f"{'-':>8}"
            spec_lines.append(f"| {name:<{w}} | {k:>4} | {drafted:7.2f} | {emitted:7.2f} | {alpha:.3f} | {draft_mb} | "
                              f"{draft_ms * 1e3:8.2f} | {c:.3f} | {verify_cost:5.2f} | {rate / first:8.2f}x | "
                              f"{predicted:9.2f}x | {predicted / verify_cost:11.2f}x |")
    if spec_lines:
        print("\nspeculative rows against the first row, per emitted token. drafted / emitted: tokens a round (mean);"
              " draft MB / ms: what a draft step reads and takes; c = draft step / verify time; v = verify time / "
              "plain step time; predicted: (1 - a^(K+1)) / ((1 - a)(K c + 1)) at K = drafted; last column = "
              "predicted / v")
        print(f"| {'row':<{w}} |    K | drafted | emitted | alpha | draft MB | draft ms | c     | v     | measured | "
              "predicted | predicted/v |")
        print(f"|{'-' * (w + 2)}|------|---------|---------|-------|----------|----------|-------|-------|----------|"
              "-----------|-------------|")
        print("\n".join(spec_lines))


def report_contended(setups, idle, busy, runs):
    """Idle and busy speeds side by side; threads: how many our decode loop ended with beside the busy process."""
    w = max(24, *(len(setup[0]) for setup in setups))
    first_idle, first_busy = (statistics.median(r[0] for r in results[0]) for results in (idle, busy))
    print(f"| {'row':<{w}} | {'idle tok/s':>10} | {'busy tok/s':>10} | {'busy / idle':>11} | {'threads busy':>12} | "
          f"{'vs first idle':>13} | {'vs first busy':>13} | same tokens |")
    print(f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 12}|{'-' * 13}|{'-' * 14}|{'-' * 15}|{'-' * 15}|-------------|")
    for j, (name, *_, baseline, _) in enumerate(setups):
        rate_idle, rate_busy = (statistics.median(r[0] for r in results[j]) for results in (idle, busy))
        threads = [s["threads"] for _, _, s in busy[j] if s.get("threads")]
        threads = f"{min(threads)}-{max(threads)}" if threads and min(threads) != max(threads) else \
            str(threads[0]) if threads else "-"
        same = same_tokens(idle, j, runs, baseline, also=busy)
        print(f"| {name:<{w}} | {rate_idle:10.2f} | {rate_busy:10.2f} | {100 * rate_busy / rate_idle:10.0f}% | "
              f"{threads:>12} | {rate_idle / first_idle:12.2f}x | {rate_busy / first_busy:12.2f}x | "
              f"{same:>11} |", flush=True)


def bench(opts):
    rows = opts.rows.split(",")
    check_rows(rows, opts)
    torch._dynamo.config.recompile_limit = 64  # every row compiles the same step functions for its own model
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold compile, unless the caller chose a cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    torch.manual_seed(0)
    model = load_row_model(opts)
    opts.eos_ids = ()
    if opts.random_weights:  # random prompts as long as HumanEval's first ones
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, model.args.vocab_size, ((125, 118, 81, 133, 194)[i % 5],), generator=g).tolist()
                   for i in range(opts.num_prompts)]
    else:
        tokenizer = Tokenizer(resolve_checkpoint(opts.checkpoint_path)[0])
        opts.eos_ids = tokenizer.eos_ids if opts.stop_at_eos else ()
        prompts = [tokenizer.encode(task["prompt"]) for task in humaneval_tasks(opts.num_prompts)]
    # A shared VM's bandwidth swings within minutes: it is read before the rows and after every prompt, and the
    # roofline is the most it read.
    def read_bandwidth():
        readings.append(memory_bandwidth_gb_s(4096 if opts.device != "cpu" else 1024, device=opts.device))
    readings = []
    read_bandwidth()
    bandwidth = readings[0]
    step_bytes = backend.report(model).step_bytes
    where = torch.cuda.get_device_name(opts.device) if opts.device.startswith("cuda") else \
        f"{torch.get_num_threads()} threads"
    print(f"# {opts.random_weights or opts.checkpoint_path}{' (random weights)' if opts.random_weights else ''}, "
          f"{opts.dtype}, {where}, torch {torch.__version__}, {len(prompts)} "
          f"{'random' if opts.random_weights else 'HumanEval'} prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), {opts.max_new_tokens} new tokens, "
          f"{opts.runs} runs each{', idle and beside a busy process' if opts.contended else ''}")
    print(f"# weights read per token: {step_bytes / 1e6:.1f} MB; measured memory read bandwidth: {bandwidth:.1f} GB/s")
    setups = set_up(rows, opts, model, prompts, step_bytes)
    results = timed_turns(setups, len(prompts), opts.runs, opts.contended, after_each_prompt=read_bandwidth)
    bandwidth = max(readings)
    print(f"# read bandwidth measured before the rows and after each prompt: {min(readings):.1f}-{bandwidth:.1f} GB/s "
          f"({len(readings)} probes); the table's roofline is the highest")
    if opts.contended:
        report_contended(setups, *results, opts.runs)
    else:
        print_table(setups, *results, bandwidth, opts.runs)


def main(argv=None):
    p = OneLineErrors(description=__doc__)
    p.add_argument("--checkpoint_path", help="the checkpoint (or give --random_weights)")
    p.add_argument("--random_weights", metavar="CONFIG", help="a config.json: that model's shapes, random weights")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--draft_config", metavar="CONFIG", help="the shapes of the spec-random rows' draft (a config.json)")
    p.add_argument("--draft_checkpoint", help="the spec-draft rows' draft model (same vocabulary)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--num_prompts", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2, help="timed runs per prompt")
    p.add_argument("--rows", default="compiled,eager,hf",
                   help="comma-separated: compiled, eager, hf, hf-draft (transformers' assisted generation with "
                        "--draft_checkpoint), quant-MODE (CKPT/model.MODE.safetensors, compiled), "
                        "llama.cpp (with --gguf), and speculative rows spec-DRAFTER[-K] with DRAFTER in self, "
                        "random, ngram, draft (--draft_checkpoint) or a quantize.py mode (the target's own quantized "
                        "file) and K an int or auto (default --speculate_k)")
    p.add_argument("--speculate_k", default="4")
    p.add_argument("--gguf", help="GGUF file for the optional llama.cpp row (needs llama-cpp-python)")
    p.add_argument("--stop_at_eos", action="store_true",
                   help="our rows stop at the checkpoint's EOS, as generate.py and serve.py do (decode tok/s: the "
                        "tokens each emitted); without it every row generates exactly --max_new_tokens")
    p.add_argument("--eager_spec", action="store_true", help="run speculative rows (and their baseline) eagerly")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "aten"),
                   help="auto: the device's backend (as generate.py); torch: model.py alone; aten: CUDA's aten kernels")
    p.add_argument("--contended", action="store_true",
                   help="time every row idle and beside a busy process, and report both")
    cli.run(bench, p.parse_args(argv))


if __name__ == "__main__":
    main()
