"""Generate text from a converted checkpoint: prefill, a torch.compile'd decode step, sampling, metrics.

    python generate.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --prompt "def fib(n):" --compile
"""
import cli

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import argparse
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cpu
import gpu
import quantize
import tp
from checkpoint import InputError, OneLineErrors, map_safetensors, no_random_init, resolve_checkpoint
from model import ModelArgs, Transformer
from sampling import sample
from speculative import (MAX_SPECULATE_K, AdaptiveK, ModelDrafter, NgramDrafter, compile_step,
                         speculative_decode, verify)
from tokenizer import Tokenizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
BACKENDS = ("auto", "torch")
CACHE_ROUNDING = 256  # cache lengths are rounded up so that nearby requests reuse one cache (and one graph)


# ---------------------------------------------------------------- loading

def load_model(checkpoint_path, device="cpu", dtype=torch.bfloat16, tp_group=None, backend="auto",
               phases=None) -> Transformer:
    """Build on the meta device, then assign the mapped tensors: the weights are never held twice.
    A file written by quantize.py carries its mode in the metadata and gets quantized modules.
    With a process group (torchrun), tp.py slices the mapped tensors first, so each rank copies only its shard.
    backend "auto": on CPU the CPU backend serves the model where it proves to compute what model.py does (cpu/),
    on CUDA int4 layers run on tinygemm (gpu.py); "torch": model.py alone. `phases`: a dict that gets the seconds
    each part of the load took."""
    phases = {} if phases is None else phases
    start = time.perf_counter()
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend}: unknown; use {' or '.join(BACKENDS)}")
    ckpt_dir, weights_path = resolve_checkpoint(checkpoint_path)
    args = ModelArgs.from_config(ckpt_dir / "config.json")
    tensors, metadata = map_safetensors(weights_path)
    mode = metadata.get("quantization")
    if mode:
        if mode not in quantize.MODES:
            raise InputError(f"{weights_path}: unknown quantization '{mode}' in the metadata; re-run quantize.py")
        groupsize = metadata.get("groupsize", "128")
        if mode == "int4" and groupsize not in map(str, quantize.INT4_GROUPSIZES):
            raise InputError(f"{weights_path}: groupsize '{groupsize}' in the metadata is not one of "
                             f"{quantize.INT4_GROUPSIZES}; re-run quantize.py")
        args = dataclasses.replace(args, tie_embeddings=False)  # quantize.py stores its own LM head
    with torch.device("meta"), no_random_init():
        model = Transformer(args)
        if mode:
            quantize.replace_linears(model, mode, int(groupsize) if mode == "int4" else 32)
    expected = model.state_dict()
    if args.tie_embeddings:
        expected.pop("output.weight")
    for name, param in expected.items():
        if name not in tensors:
            raise InputError(f"{weights_path}: missing tensor '{name}' (does config.json match the weights?)")
        if tensors[name].shape != param.shape:
            raise InputError(f"{weights_path}: tensor '{name}' has shape {list(tensors[name].shape)}, config.json "
                             f"implies {list(param.shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise InputError(f"{weights_path}: unexpected tensor '{unexpected[0]}' (does config.json match?)")
    model.load_state_dict({name: tensors[name] for name in expected}, assign=True, strict=False)
    model.tie_weights()
    phases["map and build"] = time.perf_counter() - start
    start = time.perf_counter()
    if tp_group is not None:
        tp.apply_tp(model, tp_group)
    model.to(device=device, dtype=dtype)  # floating tensors only; a no-op (still the map) where they match
    phases["shard and cast"] = time.perf_counter() - start
    if backend == "auto":
        apply_backend(model, tensors, phases)
    return model.eval()


def apply_backend(model, mapped=None, phases=None):
    """The backend of the model's device, around model.py: cpu/ on CPU, gpu.py on CUDA (each checks itself)."""
    device = model.tok_embeddings.weight.device.type
    if device == "cpu":
        cpu.apply(model, mapped, phases)
    elif device == "cuda":
        gpu.apply(model)


def model_bytes_per_step(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter and quantized weight buffer, or where a backend
    serves a product, the operands it streams instead; an untied embedding table counts one row."""
    tensors = {id(p): p for p in model.parameters()}
    for module in model.modules():
        tensors.update({id(b): b for name, b in module.named_buffers(recurse=False)
                        if name in ("weight", "scales", "scales_and_zeros", "packed")})  # packed: gpu.py's int4
    for module in model.modules():
        if hasattr(module, "operands"):  # served by a backend: what it reads instead of the file's layout
            for name in ("weight", "scales", "scales_and_zeros"):
                tensors.pop(id(getattr(module, name, None)), None)
            tensors.update({id(t): t for t in module.operands()[:2] if t is not None})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not model.args.tie_embeddings:
        total -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    return total


# ---------------------------------------------------------------- the steps

def prefill(model, tokens, input_pos, logits_idx, temperature, top_k, top_p):
    logits = model(tokens, input_pos, logits_idx)  # [B, 1, V]
    return sample(logits[:, -1], temperature, top_k, top_p)


def decode_one_token(model, token, input_pos, temperature, top_k, top_p):
    logits = model(token[:, None], input_pos[:, None])
    return sample(logits[:, -1], temperature, top_k, top_p)


class Step:
    """A step function (decode, verify), compiled or not: torch.compile(fullgraph=True) with Inductor's public
    options (speculative.compile_options), CUDA graphs on GPU ("reduce-overhead"), and without its size and
    alignment asserts, which re-checked every weight's and kernel output's shape on each call (519 asserts in a
    SmolLM2 decode step, 1.1 ms of 17.3; weights cannot change under a loaded model). Every 16-bit rounding of the
    eager program is kept inside fused kernels (emulate_precision_casts): otherwise a verify graph and a decode
    graph fuse differently, round differently, and a bf16 speculative run drifts from plain decoding (measured on
    SmolLM2 bf16: no cost). A model whose backend made each step one kernel call says so (eager_steps: the CPU
    backend's one-call step) and runs it as it is: compiled around that call, an int8 SmolLM2 decode step took 6.18
    ms against 5.90 (Dynamo's entry and guards) after 4.6 s of compiling. (On CPU, Inductor's C++ wrapper, calling a
    compiled step's kernels from C++: bf16 0.92-0.94x the time, mxfp6 1.13x, cold compiles ~2x as long, and no tp.py
    collectives; not used.)"""

    def __init__(self, fn, compile=False, device="cpu"):
        self.fn, self.compiled = fn, None
        if compile:
            self.compiled = compile_step(fn, device)

    def __call__(self, model, *args):
        if self.compiled is None or getattr(model, "eager_steps", False):
            return self.fn(model, *args)
        return self.compiled(model, *args)


class Steps:
    """The prefill, decode and verify functions, compiled or not. Compiled once per process and reused; a second
    speculate_k makes the verify one graph for any K."""

    def __init__(self, compile=False, compile_prefill=False, device="cpu"):
        self.decode, self.verify = Step(decode_one_token, compile, device), Step(verify, compile, device)
        self.prefill = torch.compile(prefill, fullgraph=True, dynamic=True) if compile_prefill else prefill


def cache_length(longest_prompt: int, max_new_tokens: int, args: ModelArgs, extra: int = 0) -> int:
    needed = longest_prompt + max_new_tokens + extra
    if needed > args.max_seq_len:
        raise InputError(f"prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds "
                         f"the model's context of {args.max_seq_len} (config.json max_seq_len); shorten the prompt "
                         "or lower --max_new_tokens")
    return min(-(-needed // CACHE_ROUNDING) * CACHE_ROUNDING, args.max_seq_len)


def spare_positions(drafter, speculate_k) -> int:
    """Cache slots a speculative run may write past a row's last token (verify writes K+1 ahead)."""
    return 2 * ((AdaptiveK.k_max if speculate_k == "auto" else speculate_k) + 1) if drafter else 0


def presize_caches(model, drafter, batch_size, longest_prompt, max_new_tokens, speculate_k):
    """Allocate the caches a request needs before compiling, so the timed run reuses the compiled shapes."""
    length = cache_length(longest_prompt, max_new_tokens, model.args, spare_positions(drafter, speculate_k))
    model.setup_caches(batch_size, length)


def steps_in_one_call(model, drafter) -> bool:
    """Whether every step of this loop, the target's and a draft model's, is one kernel call (eager_steps: the CPU
    backend's one-call step, which sums each output on one thread): the steps whose results cpu.ThreadSizer cannot
    change (compiled steps would recompile for a new thread count, and Inductor's reductions may split another
    way)."""
    models = [model] + ([drafter.model] if hasattr(drafter, "model") else [])
    return all(getattr(m, "eager_steps", False) for m in models)


class NoSizer:  # steps that are not one kernel call run on the threads they were given
    threads = None

    def __call__(self):
        pass


def keeps_thread_count(fn):
    """The caller gets its thread count back from a loop whose cpu.ThreadSizer changed it, also after an error."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
    return wrapper


@keeps_thread_count
@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, steps: Steps, temperature=0.0, top_k=None,
             top_p=None, eos_ids=(), on_token=None, drafter=None, speculate_k=5, sync_every=None):
    """Generate for a batch of prompts (ragged lengths allowed). Returns (new tokens per row, stats).

    Rows are right-padded; each row runs at its own positions, so padding is never attended and is
    overwritten as the row decodes. A row stops at its first EOS (kept in its output) or at max_new_tokens; the
    batch stops when every row has. `on_token(tokens)` gets each step's host token ids for row 0.
    With a `drafter` (speculative.py), each step is a speculative round of speculate_k drafts (an int, or
    "auto": chosen online by speculative.AdaptiveK). Where its steps are single kernel calls (steps_in_one_call),
    the loop's threads follow the cores other processes leave free (cpu.ThreadSizer); stats["threads"] is how many it
    ended with. Plain decoding looks at its tokens on the host every `sync_every` steps (default: 8 on CUDA, where
    each look waits for the GPU; 1 elsewhere): a row that ends within those steps has decoded past its end, and
    those tokens are dropped.
    """
    adaptive = AdaptiveK() if speculate_k == "auto" else None
    device = model.tok_embeddings.weight.device
    sync_every = sync_every or (8 if device.type == "cuda" else 1)
    B = len(prompts)
    if min(len(p) for p in prompts) == 0:
        raise InputError("empty prompt: give at least one token")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    k_max = adaptive.k_max if adaptive else speculate_k
    spare = spare_positions(drafter, speculate_k)
    cache_len = max(model.max_seq_len, cache_length(T, max_new_tokens, model.args, spare))
    model.setup_caches(B, cache_len)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    # Padding sits at the positions the row will decode into next, so it is overwritten before it is seen.
    input_pos = torch.arange(T, device=device).expand(B, T).contiguous()
    t0 = time.perf_counter()
    token = steps.prefill(model, tokens, input_pos, (lengths - 1)[:, None], temperature, top_k, top_p)
    if drafter:
        drafter.prefill(tokens, input_pos, cache_len)
    outputs = [[t] for t in token.tolist()]
    stats = {"prefill_s": time.perf_counter() - t0}
    done = [t in eos_ids or max_new_tokens == 1 for t in token.tolist()]
    if on_token:
        on_token(outputs[0][:])
    pos = lengths.clone()  # position of each row's newest token, not yet in the cache
    histories = [list(p) + o for p, o in zip(prompts, outputs)]
    rounds, accept_counts, ks = 0, [0] * (k_max + 1), []
    draft_s = verify_s = 0.0
    drafted = tried = accepted = 0  # draft tokens proposed, judged, accepted
    sizer = cpu.ThreadSizer() if steps_in_one_call(model, drafter) else NoSizer()
    while not all(done):
        active = torch.tensor([not d for d in done], device=device)
        if drafter is None:
            # no row may pass its max_new_tokens (nor the cache): at most the fewest tokens a running row may add
            chunk = min(sync_every, min(max_new_tokens - len(o) for o, d in zip(outputs, done) if not d))
            produced = []
            for _ in range(chunk):
                token = steps.decode(model, token, pos, temperature, top_k, top_p)
                pos += active
                produced.append(token)
            new = torch.stack(produced, 1).tolist()  # one sync for the chunk
        else:
            # Under tensor parallelism every rank must verify the same K; timings differ between ranks.
            k = tp.from_rank0(adaptive.k) if adaptive else speculate_k
            # A request's last round drafts only what its longest row can still emit (K = 4, 128 tokens: 3 of ~105
            # draft steps were drafting tokens that would be cut off).
            drafts = min(k, max(max_new_tokens - len(o) for o, d in zip(outputs, done) if not d) - 1)
            draft, n, next_token, timing = speculative_decode(model, drafter, histories, pos, k, steps.verify,
                                                              temperature, top_k, top_p, drafts)
            draft_s, verify_s, drafted = draft_s + timing[0], verify_s + timing[1], drafted + drafts
            n_list = n.tolist()
            new = [d[:m] + [t] for d, m, t in zip(draft.tolist(), n_list, next_token.tolist())]
            round_accepted = round_tried = 0
            for b in range(B):
                if not done[b]:
                    if drafts == k:  # the histogram is over rounds of K drafts
                        accept_counts[n_list[b]] += 1
                    m = min(n_list[b], drafts)  # accepted padding is cut off: not counted
                    round_accepted, round_tried = round_accepted + m, round_tried + min(m + 1, drafts)
            tried, accepted = tried + round_tried, accepted + round_accepted
            ks.append(k)
            if adaptive and drafts == k:
                adaptive.update(round_accepted, round_tried, timing[0] / k, timing[1])
            pos += (n + 1) * active  # a finished row stays where it is
        rounds += chunk if drafter is None else 1
        shown = len(outputs[0])
        for b in range(B):
            if done[b]:
                continue
            histories[b] += new[b]
            for t in new[b]:
                outputs[b].append(t)
                if t in eos_ids or len(outputs[b]) == max_new_tokens:
                    done[b] = True
                    break
        if drafter is not None:  # (plain decoding feeds its last step's tokens: a finished row's are not read)
            token = torch.tensor([h[-1] for h in histories], device=device)
        if on_token and len(outputs[0]) > shown:
            on_token(outputs[0][shown:])
        sizer()
    stats.update(total_s=time.perf_counter() - t0, decode_steps=rounds, threads=sizer.threads)
    if drafter:
        counted = sum(accept_counts)
        tokens_in_full_rounds = sum((i + 1) * c for i, c in enumerate(accept_counts))
        stats.update(accept_counts=accept_counts, speculate_k=max(set(ks), key=ks.count) if ks else k_max,
                     mean_accepted=tokens_in_full_rounds / max(counted, 1), alpha=accepted / max(tried, 1),
                     draft_cost_ratio=(draft_s / max(drafted, 1)) / (verify_s / rounds) if rounds else 0.0,
                     verify_s_per_round=verify_s / max(rounds, 1))
    return outputs, stats


# ---------------------------------------------------------------- CLI

def parse_prompt(prompt: str, tokenizer: Tokenizer, seed: int) -> list[int]:
    if prompt.strip().isdigit():  # a synthetic prompt of that many tokens
        n = int(prompt)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist()
    return tokenizer.encode(prompt)


class TextStream:
    """Prints a row's text as it grows, holding back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, tokens):
        self.ids += [t for t in tokens if t not in self.tokenizer.eos_ids]
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)

    def finish(self):
        """Print what is held back, as --json's text has it (a partial character decodes as U+FFFD), and a newline."""
        print(self.tokenizer.decode(self.ids)[self.printed:], flush=True)


def speculate_k_arg(value: str):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"'{value}' is not a positive integer or 'auto'")
    return int(value)


def build_parser():
    p = OneLineErrors(description="Generate text from a converted checkpoint.")
    p.add_argument("--checkpoint_path", required=True, help="checkpoint directory or its .safetensors file")
    p.add_argument("--prompt", default="Hello, my name is", help="text, or an integer for a synthetic prompt")
    p.add_argument("--max_new_tokens", type=int, default=128, help="generation also stops at EOS")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens")
    p.add_argument("--top_p", type=float, default=None, help="sample within this probability mass")
    p.add_argument("--num_samples", type=int, default=1, help="samples run one after another")
    p.add_argument("--batch_size", type=int, default=1, help="the prompt is repeated in each batch row")
    p.add_argument("--seed", type=int, default=1234, help="sampling and synthetic prompts")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode and verify steps (with the CPU "
                   "backend a Llama-family model's steps are one few_rows.cpp call and need none)")
    p.add_argument("--compile_prefill", action="store_true", help="torch.compile prefill (dynamic shapes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp32 or fp16")
    p.add_argument("--backend", default="auto", help="auto (default): on CPU the few_rows.cpp kernels serve the "
                   "model where they prove to compute what model.py computes; torch: model.py's PyTorch alone")
    p.add_argument("--json", action="store_true", help="one JSON object per generated sequence, no streaming (with "
                   "the load's time and phases)")
    p.add_argument("--verbose", action="store_true", help="say what loading took, phase by phase")
    p.add_argument("--draft_checkpoint", help="speculative decoding with this draft model (same tokenizer)")
    p.add_argument("--draft", choices=["model", "ngram"], default=None,
                   help="drafter: model (needs --draft_checkpoint) or ngram (prompt lookup, no model)")
    p.add_argument("--speculate_k", type=speculate_k_arg, default=5,
                   help="tokens drafted per speculative round, or 'auto' (chosen online from measured alpha and c)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="tensor parallelism: this many ranks on this host "
                   "(as torchrun starts them; gloo on CPU, NCCL with one GPU each)")
    return p


def check_options(opts):
    if opts.dtype not in DTYPES:
        raise InputError(f"--dtype {opts.dtype}: unknown; use bf16, fp32 or fp16")
    if opts.backend not in BACKENDS:
        raise InputError(f"--backend {opts.backend}: unknown; use {' or '.join(BACKENDS)}")
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(opts, name) < 1:
            raise InputError(f"--{name} must be at least 1")
    if not math.isfinite(opts.temperature) or opts.temperature < 0:
        raise InputError(f"--temperature must be a finite number >= 0 (0 = greedy), not {opts.temperature}")
    if opts.top_k is not None and opts.top_k < 1:
        raise InputError("--top_k must be at least 1")
    if opts.top_p is not None and not 0 < opts.top_p <= 1:
        raise InputError("--top_p must be in (0, 1]")
    if opts.speculate_k != "auto" and opts.speculate_k > MAX_SPECULATE_K:
        raise InputError(f"--speculate_k {opts.speculate_k}: at most {MAX_SPECULATE_K} (or auto)")
    if opts.draft == "model" and not opts.draft_checkpoint:
        raise InputError("--draft model needs --draft_checkpoint PATH")
    if opts.draft == "ngram" and opts.draft_checkpoint:
        raise InputError("--draft ngram uses no model; drop --draft_checkpoint (or use --draft model)")
    if opts.nproc_per_node < 1:
        raise InputError(f"--nproc_per_node {opts.nproc_per_node}: must be at least 1")
    if not 0 <= opts.seed < 2**64:
        raise InputError(f"--seed {opts.seed}: must be between 0 and 2**64 - 1")
    check_device(opts.device)
    if torch.device(opts.device).type == "cuda" and opts.nproc_per_node > torch.cuda.device_count():
        raise InputError(f"--nproc_per_node {opts.nproc_per_node}: this host has {torch.cuda.device_count()} GPUs; "
                         "launch at most one rank per GPU")


def check_device(device):
    """cpu or cuda[:N], and present."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise InputError(f"--device {device}: not supported; use cpu or cuda")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"--device {device}: not available ({reason[:160]})") from None


def check_draft(opts, tokenizer, target_args) -> ModelArgs | None:
    """The draft checkpoint's files, tokenizer and vocabulary, before any model is loaded: its config, or None."""
    if not opts.draft_checkpoint:
        return None
    try:
        draft_dir, _ = resolve_checkpoint(opts.draft_checkpoint)
    except InputError as e:
        raise InputError(f"--draft_checkpoint {opts.draft_checkpoint}: {e}") from None
    draft_tokenizer = Tokenizer(draft_dir)
    if not tokenizer.same_vocabulary(draft_tokenizer):
        raise InputError(f"{draft_tokenizer.path}: the draft's tokenizer differs from the target's "
                         f"({tokenizer.path}); speculation needs the same vocabulary")
    draft_args = ModelArgs.from_config(draft_dir / "config.json")
    if draft_args.vocab_size != target_args.vocab_size:
        raise InputError(f"{draft_dir / 'config.json'}: vocab_size {draft_args.vocab_size} differs from the "
                         f"target's {target_args.vocab_size}; speculation needs the same vocabulary")
    return draft_args


def make_drafter(opts, dtype, device, phases=None):
    """The drafter named by the flags (checked first by check_draft), or None."""
    kind = opts.draft or ("model" if opts.draft_checkpoint else None)
    if kind == "ngram":
        return NgramDrafter()
    if kind is None:
        return None
    draft = load_model(opts.draft_checkpoint, device, dtype, backend=opts.backend, phases=phases)  # replicated: tp.py
    return ModelDrafter(draft, compile=opts.compile)


def check_request(opts):
    """Every check that needs no model: flags, files, tokenizers, the prompt against the target's and the draft's
    context. Returns (checkpoint directory, tokenizer, prompt)."""
    check_options(opts)
    ckpt_dir, _ = resolve_checkpoint(opts.checkpoint_path)
    args = ModelArgs.from_config(ckpt_dir / "config.json")
    tp.check_split(args, int(os.environ.get("WORLD_SIZE", opts.nproc_per_node)))  # the draft is replicated
    tokenizer = Tokenizer(ckpt_dir)
    prompt = parse_prompt(opts.prompt, tokenizer, opts.seed)
    if not prompt:
        raise InputError(f"--prompt {opts.prompt!r}: no tokens; give text or a number of tokens >= 1")
    draft_args = check_draft(opts, tokenizer, args)
    spare = spare_positions(opts.draft_checkpoint or opts.draft == "ngram", opts.speculate_k)
    for model_args in (args, draft_args) if draft_args else (args,):
        cache_length(len(prompt), opts.max_new_tokens, model_args, spare)
    return ckpt_dir, tokenizer, prompt


def say_phases(name, seconds, phases):
    print(f"{name} in {seconds:.2f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), file=sys.stderr)


def run(opts):
    ckpt_dir, tokenizer, prompt = check_request(opts)
    torch.manual_seed(opts.seed)  # the same on every rank: tensor-parallel ranks draw the same tokens
    group, device = tp.init_from_env(opts.device)
    rank0 = tp.is_rank0()  # only rank 0 prints
    t = time.perf_counter()
    load_phases, draft_phases = {}, {}
    model = load_model(opts.checkpoint_path, device, DTYPES[opts.dtype], tp_group=group, backend=opts.backend,
                       phases=load_phases)
    load_s = time.perf_counter() - t
    prompts = [prompt] * opts.batch_size
    steps = Steps(opts.compile, opts.compile_prefill, device)
    sampling = dict(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    t = time.perf_counter()
    drafter = make_drafter(opts, DTYPES[opts.dtype], device, draft_phases)
    draft_load_s = time.perf_counter() - t if draft_phases else 0.0
    if opts.verbose and rank0:
        say_phases(f"loaded {ckpt_dir}", load_s, load_phases)
        if draft_phases:
            say_phases(f"loaded the draft {opts.draft_checkpoint}", draft_load_s, draft_phases)
    speculation = dict(drafter=drafter, speculate_k=opts.speculate_k)
    compile_s = 0.0
    presize_caches(model, drafter, len(prompts), len(prompt), opts.max_new_tokens, opts.speculate_k)
    if opts.compile or opts.compile_prefill:  # compile on a short warm-up so the timed runs are steady
        t = time.perf_counter()
        generate(model, prompts, 12 if drafter else 3, steps, **sampling, **speculation)
        compile_s = time.perf_counter() - t
    if group is not None:
        held = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, tp.weight_bytes(model), group=group)
    if rank0 and not opts.json and not opts.verbose:
        print(f"loaded {ckpt_dir} in {load_s:.2f} s" + (f", the draft in {draft_load_s:.2f} s" if draft_phases
                                                           else "")
              + (f", compiled in {compile_s:.1f} s" if compile_s else ""), file=sys.stderr)
        if group is not None:
            print(f"tensor parallel over {len(held)} ranks ({dist.get_backend(group)}): weights held per rank "
                  f"{', '.join(f'{b / 1e6:.1f}' for b in held)} MB", file=sys.stderr)
    load = dict(load_s=round(load_s, 3), load_phases={k: round(v, 3) for k, v in load_phases.items()})
    if draft_phases:
        load.update(draft_load_s=round(draft_load_s, 3),
                    draft_load_phases={k: round(v, 3) for k, v in draft_phases.items()})
    step_bytes = model_bytes_per_step(model)
    for sample_idx in range(opts.num_samples):
        stream = TextStream(tokenizer) if opts.batch_size == 1 and not opts.json and rank0 else None
        if stream:
            print(tokenizer.decode(prompt), end="", flush=True)
        try:
            rows, stats = generate(model, prompts, opts.max_new_tokens, steps, eos_ids=tokenizer.eos_ids,
                                   on_token=stream, **sampling, **speculation)
        finally:  # Ctrl-C included: the terminal gets the rest of the line
            if stream:
                stream.finish()
        decode_s = stats["total_s"] - stats["prefill_s"]
        longest = max(len(row) for row in rows)
        tokens_per_s = longest / stats["total_s"]
        decode_tokens_per_s = (longest - 1) / decode_s if longest > 1 else 0.0
        # Bytes of target weights read per second: one full read per decode step or verify round.
        bandwidth = step_bytes * stats["decode_steps"] / decode_s / 1e9 if decode_s > 0 else 0.0
        spec = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
                if k in ("accept_counts", "mean_accepted", "alpha", "draft_cost_ratio", "speculate_k")}
        for b, row in enumerate(rows):
            record = dict(sample=sample_idx, row=b, prompt_tokens=len(prompt), tokens=row,
                          text=tokenizer.decode([t for t in row if t not in tokenizer.eos_ids]),
                          tokens_per_s=round(tokens_per_s, 2), decode_tokens_per_s=round(decode_tokens_per_s, 2),
                          prefill_s=round(stats["prefill_s"], 4), bandwidth_gb_s=round(bandwidth, 2),
                          compile_s=round(compile_s, 2), batch_size=opts.batch_size, threads=stats["threads"], **spec,
                          **load)
            if not rank0:
                continue
            if opts.json:
                print(json.dumps(record), flush=True)
            elif not stream:
                print(f"--- sample {sample_idx} row {b}\n{tokenizer.decode(prompt)}{record['text']}")
        if rank0 and not opts.json:
            shared = stats["threads"] is not None and stats["threads"] < torch.get_num_threads()
            print(f"[{longest} tokens/row x {len(rows)} rows; {tokens_per_s:.2f} tok/s per row "
                  f"({decode_tokens_per_s:.2f} decode), {bandwidth:.2f} GB/s, prefill {stats['prefill_s']:.3f} s"
                  + (f"; on {stats['threads']} of {torch.get_num_threads()} threads: other processes keep the other "
                     "cores busy" if shared else "") + "]", file=sys.stderr)
            if spec:
                print(f"[speculative: k={spec['speculate_k']}, accept counts {spec['accept_counts']}, mean "
                      f"accepted {spec['mean_accepted']:.2f}, alpha {spec['alpha']:.3f}, draft cost ratio "
                      f"{spec['draft_cost_ratio']:.3f}]", file=sys.stderr)


def main(argv=None):
    cli.raise_interrupts()
    argv = sys.argv[1:] if argv is None else argv
    opts = build_parser().parse_args(argv)
    error = None
    try:
        if opts.nproc_per_node > 1 and os.environ.get("RANK") is None:  # the launcher: check, then start the ranks
            check_request(opts)
            sys.exit(tp.launch([__file__, *argv], opts.nproc_per_node))
        run(opts)
    except InputError as e:  # every rank meets the same bad input, so all of them get here
        error = f"error: {e}"
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (or the launcher's) adds nothing
        if tp.is_rank0():
            print("interrupted", file=sys.stderr)
        tp.finish(130, wait=False)
        sys.exit(130)
    if error:
        if tp.is_rank0():
            print(error, file=sys.stderr)
        tp.report_error(error)
    tp.finish(1 if error else 0)  # under torchrun the process ends here
    if error:
        sys.exit(1)


if __name__ == "__main__":
    main()
