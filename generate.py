"""The CLI: generate text from a converted checkpoint, plainly or speculatively, with its metrics. Every check that
needs no model runs before one loads; the loading is loading.py's, the loop decoding.py's.

    python generate.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --prompt "def fib(n):" --compile
"""
import cli

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json
import math
import os
import signal
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

import ranks
import tp
from backend import report
from chat import Chat, ChatTemplate
from checkpoint import Checkpoint, InputError, OneLineErrors, open_checkpoint
from decoding import Plan, Steps, generate, plan, presize_caches
from loading import DTYPES, add_model_flags, check_draft, check_model_options, load_model, make_drafter
from tokenizer import TextStream, Tokenizer

def parse_prompt(prompt: str, tokenizer: Tokenizer, seed: int) -> list[int]:
    if prompt.strip().isdigit():  # a synthetic prompt of that many tokens
        n = int(prompt)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist()
    return tokenizer.encode(prompt)


def build_parser():
    p = OneLineErrors(description="Generate text from a converted checkpoint.")
    add_model_flags(p)
    p.add_argument("--prompt", help="text (default 'Hello, my name is'), or an integer for a synthetic prompt; with "
                   "--chat the user's message (default: read turns from stdin, one a line)")
    p.add_argument("--chat", action="store_true", help="chat: messages formatted by the checkpoint's own chat "
                   "template, the reply ends at its end-of-turn token, later turns reuse the cache")
    p.add_argument("--max_new_tokens", type=int, default=128, help="generation also stops at EOS")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens")
    p.add_argument("--top_p", type=float, default=None, help="sample within this probability mass")
    p.add_argument("--num_samples", type=int, default=1, help="samples run one after another")
    p.add_argument("--batch_size", type=int, default=1, help="the prompt is repeated in each batch row")
    p.add_argument("--seed", type=int, default=1234, help="sampling and synthetic prompts")
    p.add_argument("--json", action="store_true", help="one JSON object per generated sequence, no streaming (with "
                   "the load's time and phases)")
    return p


def check_options(opts):
    check_model_options(opts)
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(opts, name) < 1:
            raise InputError(f"--{name} must be at least 1")
    if not math.isfinite(opts.temperature) or opts.temperature < 0:
        raise InputError(f"--temperature must be a finite number >= 0 (0 = greedy), not {opts.temperature}")
    if opts.top_k is not None and opts.top_k < 1:
        raise InputError("--top_k must be at least 1")
    if opts.top_p is not None and not 0 < opts.top_p <= 1:
        raise InputError("--top_p must be in (0, 1]")
    if opts.chat and (opts.batch_size > 1 or opts.num_samples > 1):
        raise InputError("--chat holds one conversation: drop --batch_size and --num_samples")
    if not 0 <= opts.seed < 2**64:
        raise InputError(f"--seed {opts.seed}: must be between 0 and 2**64 - 1")


class Checked(NamedTuple):
    """A request checked before any model loads: the target and draft checkpoints (each resolved and read once),
    the tokenizer, the prompt's tokens (None for a chat whose turns come from stdin), the Chat or None, the context
    check of a turn's tokens (returns its plan) and the prompt's plan, made once (decoding.generate's request)."""
    target: Checkpoint
    draft: Checkpoint | None
    tokenizer: Tokenizer
    prompt: list | None
    chat: Chat | None
    check_context: Callable
    plan: Plan


def check_request(opts) -> Checked:
    """Every check that needs no model: flags, files, tokenizers, the chat template, the prompt against the target's
    and the draft's context. With --chat, the prompt is the first turn's tokens."""
    check_options(opts)
    target = open_checkpoint(opts.checkpoint_path)
    tp.check_split(target.args, int(os.environ.get("WORLD_SIZE", opts.nproc_per_node)))  # the draft is replicated
    tokenizer = Tokenizer(target.directory, target.config)
    draft = check_draft(opts, tokenizer, target)
    speculate_k = opts.speculate_k if opts.draft_checkpoint or opts.draft == "ngram" else None

    def check_context(tokens):  # the request's plan (K, the cache), the draft's context checked beside it
        if draft:
            plan(draft.args, len(tokens), opts.max_new_tokens, speculate_k)
        return plan(target.args, len(tokens), opts.max_new_tokens, speculate_k)

    chat = None
    if opts.chat:
        chat = Chat(ChatTemplate(target.directory), tokenizer)  # renders once: a failing template is one line here
        if opts.prompt is None:
            request = check_context([tokenizer.bos_id or 0])  # the turns to come hold at least a token
            return Checked(target, draft, tokenizer, None, chat, check_context, request)
        prompt, _ = chat.ask(opts.prompt)
        if not prompt:
            raise InputError(f"{chat.template.path}: the chat template rendered no tokens for this conversation")
    else:
        prompt = parse_prompt("Hello, my name is" if opts.prompt is None else opts.prompt, tokenizer, opts.seed)
    if not prompt:
        raise InputError(f"--prompt {opts.prompt!r}: no tokens; give text or a number of tokens >= 1")
    return Checked(target, draft, tokenizer, prompt, chat, check_context, check_context(prompt))


def slow_path_notes(opts, served, device) -> list[str]:
    """The flags that leave a model slower than the user may think, each as one line naming the faster choice."""
    if torch.device(device).type != "cpu":
        return []
    if opts.backend == "torch" and not opts.compile:
        return ["note: --backend torch runs model.py eagerly, a PyTorch call per operation (SmolLM2 in bf16: 2-24 "
                "tok/s, served ~85); add --compile, or drop --backend torch for the CPU backend"]
    return []


def say_phases(name, seconds, phases):
    print(f"{name} in {seconds:.2f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), file=sys.stderr)


def run(opts):
    checked = check_request(opts)
    ckpt_dir, tokenizer, prompt, chat, request = (checked.target.directory, checked.tokenizer, checked.prompt,
                                                  checked.chat, checked.plan)
    group, device = ranks.init_from_env(opts.device)
    rank0 = ranks.is_rank0()  # only rank 0 prints
    t = time.perf_counter()
    load_phases, draft_phases = {}, {}
    model = load_model(checked.target, device, DTYPES[opts.dtype], tp_group=group, backend=opts.backend,
                       phases=load_phases)
    load_s = time.perf_counter() - t
    steps = Steps(opts.compile, opts.compile_prefill, device)
    sampling = dict(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    t = time.perf_counter()
    drafter = make_drafter(opts.draft or ("model" if opts.draft_checkpoint else None), checked.draft, device,
                           DTYPES[opts.dtype], opts.backend, opts.compile, draft_phases,
                           opts.draft_quantize or "auto", vocab=opts.draft_vocab)
    draft_load_s = time.perf_counter() - t if draft_phases else 0.0
    if opts.verbose and rank0:
        say_phases(f"loaded {ckpt_dir}", load_s, load_phases)
        if draft_phases:
            say_phases(f"loaded the draft {opts.draft_checkpoint} as {drafter.form}", draft_load_s, draft_phases)
        served = report(model)
        print(f"backend {served.name}: {served.serves}" + (f" ({served.fallback})" if served.fallback else ""),
              file=sys.stderr)
    notes = slow_path_notes(opts, report(model), device)
    if rank0:
        for line in notes:
            print(line, file=sys.stderr)
    speculation = dict(drafter=drafter, speculate_k=opts.speculate_k)
    compile_s = 0.0
    warm_up = prompt or chat.tokenizer.encode("Hello", bos=False)
    presize_caches(model, opts.batch_size, request)
    if opts.compile or opts.compile_prefill:  # warmed up: timed runs are steady
        t = time.perf_counter()
        generate(model, [warm_up] * opts.batch_size, 12 if drafter else 3, steps, **sampling, **speculation,
                 request=request if prompt else None)  # (a chat's warm-up: a turn of its own)
        compile_s = time.perf_counter() - t
    if group is not None:
        held = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, report(model).held_bytes, group=group)
    # after the load, its checks and the warm-up, whatever random numbers they drew; the same on every rank:
    # tensor-parallel ranks draw the same tokens
    torch.manual_seed(opts.seed)
    if rank0 and not opts.json and not opts.verbose:
        print(f"loaded {ckpt_dir} in {load_s:.2f} s" + (f", the draft as {drafter.form} in {draft_load_s:.2f} s"
                                                           if draft_phases else "")
              + (f", compiled in {compile_s:.1f} s" if compile_s else ""), file=sys.stderr)
        if group is not None:
            print(f"tensor parallel over {len(held)} ranks ({dist.get_backend(group)}): weights held per rank "
                  f"{', '.join(f'{b / 1e6:.1f}' for b in held)} MB", file=sys.stderr)
    load = dict(load_s=round(load_s, 3), load_phases={k: round(v, 3) for k, v in load_phases.items()})
    if draft_phases:
        load.update(draft_form=drafter.form, draft_load_s=round(draft_load_s, 3),
                    draft_load_phases={k: round(v, 3) for k, v in draft_phases.items()})
    metrics = dict(step_bytes=report(model).step_bytes, compile_s=compile_s, load=load)
    run_one = dict(model=model, steps=steps, **sampling, **speculation)
    if chat:
        return run_chat(opts, chat, prompt, checked.check_context, tokenizer, run_one, metrics, rank0)
    prompts = [prompt] * opts.batch_size
    for sample_idx in range(opts.num_samples):
        stream = TextStream(tokenizer, prompt) if opts.batch_size == 1 and not opts.json and rank0 else None
        if stream:  # the prompt as typed: without the BOS the tokenizer adds
            print(tokenizer.decode(prompt[1:] if tokenizer.add_bos and prompt[:1] == [tokenizer.bos_id] else prompt),
                  end="", flush=True)
        try:
            rows, stats = generate(prompts=prompts, max_new_tokens=opts.max_new_tokens, eos_ids=tokenizer.eos_ids,
                                   on_token=stream, request=request, **run_one)
        finally:  # Ctrl-C included: the terminal gets the rest of the line
            if stream:
                stream.finish()
        say(opts, rows, stats, dict(sample=sample_idx), prompt, tokenizer, tokenizer.eos_ids, metrics, rank0,
            shown=stream is not None, context=prompt)


def user_turns(opts, rank0):
    """The user's messages: --prompt, or one a line from stdin until its end (rank 0 reads, every rank gets it)."""
    if opts.prompt is not None:
        yield opts.prompt
        return
    while True:
        if rank0 and sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = ranks.from_rank0(sys.stdin.readline() if rank0 else None)
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def run_chat(opts, chat, prompt, check_context, tokenizer, run_one, metrics, rank0):
    """Turns of one conversation: each prefills only what its cache lacks (stats["prefilled"]), streams the reply,
    and stops at the template's end-of-turn token (or at any end-of-generation token of the checkpoint)."""
    for turn, message in enumerate(user_turns(opts, rank0)):
        tokens, cached = (prompt, 0) if turn == 0 and prompt else chat.ask(message)
        request = check_context(tokens)
        stream = TextStream(tokenizer, hidden=chat.stop_ids) if not opts.json and rank0 else None
        try:
            rows, stats = generate(prompts=[tokens], max_new_tokens=opts.max_new_tokens, eos_ids=chat.stop_ids,
                                   on_token=stream, cached=cached, request=request, **run_one)
        finally:
            if stream:
                stream.finish()
        chat.answer(rows[0])
        cut = not rows[0] or rows[0][-1] not in chat.stop_ids  # ended by --max_new_tokens, not by the template
        if cut and rank0 and not opts.json:
            print(f"[the reply was cut at --max_new_tokens {opts.max_new_tokens}; raise it for whole replies]",
                  file=sys.stderr)
        say(opts, rows, stats, dict(turn=turn, cut=cut), tokens, tokenizer, chat.stop_ids, metrics, rank0, shown=True)


def say(opts, rows, stats, which, prompt, tokenizer, stop_ids, metrics, rank0, shown, context=()):
    """A generation's records (--json: one JSON object a row; else the rows not streamed) and its stats line. A
    row's text is what it adds after `context`."""
    decode_s = stats["total_s"] - stats["prefill_s"]
    longest = max(len(row) for row in rows)
    tokens_per_s = longest / stats["total_s"]
    decode_tokens_per_s = (longest - 1) / decode_s if longest > 1 else 0.0
    # Bytes of target weights read per second: one full read per decode step or verify round.
    bandwidth = metrics["step_bytes"] * stats["decode_steps"] / decode_s / 1e9 if decode_s > 0 else 0.0
    spec = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
            if k in ("accept_counts", "mean_accepted", "mean_drafted", "alpha", "draft_cost_ratio", "speculate_k")}
    if not rank0:
        return
    for b, row in enumerate(rows):
        record = dict(**which, row=b, prompt_tokens=len(prompt), prefilled_tokens=len(prompt) - stats["prefilled"][0],
                      tokens=row, text=tokenizer.decode_after(context, [t for t in row if t not in stop_ids]),
                      tokens_per_s=round(tokens_per_s, 2), decode_tokens_per_s=round(decode_tokens_per_s, 2),
                      prefill_s=round(stats["prefill_s"], 4), bandwidth_gb_s=round(bandwidth, 2),
                      compile_s=round(metrics["compile_s"], 2), batch_size=len(rows), threads=stats["threads"], **spec,
                      **metrics["load"])
        if opts.json:
            print(json.dumps(record), flush=True)
        elif not shown:
            print(f"--- sample {which['sample']} row {b}\n{tokenizer.decode(prompt)}{record['text']}")
    if not opts.json:
        shared = stats["threads"] is not None and stats["threads"] < torch.get_num_threads()
        print(f"[{longest} tokens/row x {len(rows)} rows; {tokens_per_s:.2f} tok/s per row "
              f"({decode_tokens_per_s:.2f} decode), {bandwidth:.2f} GB/s, prefill {stats['prefill_s']:.3f} s"
              + (f" ({len(prompt) - stats['prefilled'][0]} of {len(prompt)} tokens)" if "turn" in which else "")
              + (f"; on {stats['threads']} of {torch.get_num_threads()} threads: other processes keep the other "
                 "cores busy" if shared else "") + "]", file=sys.stderr)
        if spec:
            form = metrics["load"].get("draft_form")
            print(f"[speculative: {f'draft {form}, ' if form else ''}k={spec['speculate_k']}, drafted "
                  f"{spec['mean_drafted']:.2f} and emitted {spec['mean_accepted']:.2f} tokens a round, accept counts "
                  f"{spec['accept_counts']}, alpha {spec['alpha']:.3f}, draft cost ratio "
                  f"{spec['draft_cost_ratio']:.3f}]", file=sys.stderr)


def main(argv=None):
    cli.raise_interrupts()
    argv = sys.argv[1:] if argv is None else argv
    opts = build_parser().parse_args(argv)
    error = None
    try:
        if opts.nproc_per_node > 1 and os.environ.get("RANK") is None:  # the launcher: check, then start the ranks
            check_request(opts)
            sys.exit(ranks.launch([__file__, *argv], opts.nproc_per_node))
        run(opts)
    except InputError as e:  # every rank meets the same bad input, so all of them get here
        error = f"error: {e}"
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (or the launcher's) adds nothing
        if ranks.is_rank0():
            print("interrupted", file=sys.stderr)
        ranks.finish(130, wait=False)
        sys.exit(130)
    if error:
        if ranks.is_rank0():
            print(error, file=sys.stderr)
        ranks.report_error(error)
    ranks.finish(1 if error else 0)  # under torchrun the process ends here
    if error:
        sys.exit(1)


if __name__ == "__main__":
    main()
