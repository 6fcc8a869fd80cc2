"""The decode loop: prefill, the decode and verify steps (torch.compile'd or not), speculative rounds, the loop's
threads, and the stats generate.py prints. A model comes from loading.load_model; what its backend did is in
backend.report(model).
"""
import contextlib
import dataclasses
import functools
import os
import time

import torch

import ranks
from backend import LONGEST_VERIFY, report
from checkpoint import InputError
from model import ModelArgs
from speculative import (STEP_CONFIG, DraftLength, ModelDrafter, any_length, compile_step, forward, sample,
                         speculative_decode, verify)

CACHE_ROUNDING = 256  # cache lengths are rounded up so that nearby requests reuse one cache (and one graph)


def prefill(model, tokens, input_pos, logits_idx, temperature, top_k, top_p):
    logits = model(tokens, input_pos, logits_idx)  # [B, 1, V]
    return sample(logits[:, -1], temperature, top_k, top_p)


def decode_one_token(model, token, input_pos, temperature, top_k, top_p):
    logits = model(token[:, None], input_pos[:, None])
    return sample(logits[:, -1], temperature, top_k, top_p)


def step(fn, compile=False, device="cpu"):
    """A step function (decode, verify), compiled or not: torch.compile(fullgraph=True) of model.py's forward and the
    sampling after it, with speculative.compile_options (no size or alignment asserts: the weights cannot change under
    a loaded model; every 16-bit rounding of the eager program kept, so a verify graph rounds as a decode graph does),
    CUDA graphs on GPU."""
    return compile_step(fn, device) if compile else fn


class Steps:
    """The prefill, decode and verify functions, compiled or not. Compiled once per process and reused; the verify is
    one graph for rounds of any length (speculative.any_length)."""

    def __init__(self, compile=False, compile_prefill=False, device="cpu"):
        self.decode = step(decode_one_token, compile, device)
        self.verify = functools.partial(verify, any_length(compile_step(forward, device)) if compile else forward)
        self.prefill = prefill
        if compile_prefill:  # one graph for any prompt length (speculative.STEP_CONFIG while it runs)
            self.prefill = torch._dynamo.config.patch(**STEP_CONFIG)(torch.compile(prefill, fullgraph=True, dynamic=True))


def cache_length(longest_prompt: int, max_new_tokens: int, args: ModelArgs, extra: int = 0) -> int:
    needed = longest_prompt + max_new_tokens + extra
    if needed > args.max_seq_len:
        ahead = f" + {extra} positions a verify writes ahead" if extra else ""
        raise InputError(f"prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}){ahead} = {needed} "
                         f"exceeds the model's context of {args.max_seq_len} (config.json max_seq_len); shorten the "
                         "prompt or lower --max_new_tokens")
    return min(-(-needed // CACHE_ROUNDING) * CACHE_ROUNDING, args.max_seq_len)


def most_drafts(speculate_k, verify_limit=None) -> int:
    """The most drafts a round verifies: speculate_k, or for "auto" the most speculative.DraftLength drafts; at most
    backend.LONGEST_VERIFY - 1, lowered to what the backend verifies exactly (verify_limit tokens a row,
    backend.Report.max_verify_tokens; None: no lower limit). A speculate_k past that is an error."""
    limit = min(LONGEST_VERIFY, verify_limit or LONGEST_VERIFY)
    if speculate_k == "auto":
        return limit - 1
    if speculate_k + 1 > limit:
        raise InputError(f"--speculate_k {speculate_k}: at most {limit - 1} (or auto)" + (
            f" with this backend, whose verify computes at most {limit} tokens a row exactly" if limit < LONGEST_VERIFY
            else ": a longer verify paid on no CPU or GPU measured"))
    return speculate_k


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request checked once, before anything runs: the most drafts a round verifies (0 without a drafter), the KV
    cache length it needs, and the K asked (None without a drafter)."""
    k_max: int
    cache_len: int
    speculate_k: int | str | None = None

    def within(self, verify_limit) -> "Plan":
        """This plan for a loaded model whose backend verifies at most verify_limit tokens a row exactly
        (backend.Report.max_verify_tokens): auto's K lowered to it, a K past it refused."""
        if self.speculate_k is None or verify_limit is None:
            return self
        return dataclasses.replace(self, k_max=most_drafts(self.speculate_k, verify_limit))


def plan(args: ModelArgs, longest_prompt: int, max_new_tokens: int, speculate_k=None, verify_limit=None) -> Plan:
    """The plan of a request: speculate_k None without a drafter. A verify writes K + 1 tokens past a row's newest,
    so a speculative request keeps 2 (K + 1) spare cache positions (K at its largest for "auto", whatever the
    backend: the cache a request gets does not depend on which backend serves it)."""
    if speculate_k is None:
        return Plan(0, cache_length(longest_prompt, max_new_tokens, args))
    return Plan(most_drafts(speculate_k, verify_limit),
                cache_length(longest_prompt, max_new_tokens, args, spare_positions(speculate_k)), speculate_k)


def spare_positions(speculate_k) -> int:
    """The cache positions a request keeps past its prompt and max_new_tokens: 2 (K + 1) with a drafter (a verify
    writes K + 1 past a row's newest; K at its largest for "auto"), none without (speculate_k None)."""
    if speculate_k is None:
        return 0
    return 2 * ((LONGEST_VERIFY - 1 if speculate_k == "auto" else speculate_k) + 1)


def presize_caches(model, batch_size, request: Plan):
    """Allocate the caches a request needs before compiling, so the timed run reuses the compiled shapes."""
    model.setup_caches(batch_size, request.cache_len)


def sizes_threads(model, drafter) -> bool:
    """Whether every model of this loop, the target and a draft model, gives the same results on any thread count
    (backend.Report.sizes_threads), so that the loop may follow the cores other processes leave free."""
    models = [model] + ([drafter.model] if isinstance(drafter, ModelDrafter) else [])
    return all(report(m).sizes_threads for m in models)


class NoSizer:  # the loop runs on the threads it was given
    threads = None

    def __call__(self):
        pass


def keeps_thread_count(fn):
    """The caller gets its thread count back from a loop whose ThreadSizer changed it, also after an error."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
    return wrapper


class Acceptance:
    """A speculative run's tallies: rounds by drafts accepted, drafts proposed, judged and accepted, and the time
    drafting and verifying took (the stats generate.py prints)."""

    def __init__(self, k_max, speculate_k):
        self.counts, self.speculate_k = [0] * (k_max + 1), speculate_k
        self.draft_s = self.verify_s = 0.0
        self.rounds = self.drafted = self.tried = self.accepted = 0

    def add(self, drafts, n, done, timing, whole=True):
        """A round of `drafts` drafts (padding not counted) that accepted n[b] in each row not done; -> (accepted,
        judged) in the rows not done. The histogram counts whole rounds: not a fixed K's last, cut short."""
        self.draft_s, self.verify_s = self.draft_s + timing[0], self.verify_s + timing[1]
        self.drafted += drafts
        self.rounds += 1
        accepted = tried = 0
        for m, finished in zip(n, done):
            if not finished:
                m = min(m, drafts)  # accepted padding is cut off: not counted
                self.counts[m] += whole
                accepted, tried = accepted + m, tried + min(m + 1, drafts)
        self.tried, self.accepted = self.tried + tried, self.accepted + accepted
        return accepted, tried

    def stats(self, rounds) -> dict:
        """accept_counts: rows' rounds by drafts accepted; mean_accepted: tokens a row's round emits (accepted + 1);
        mean_drafted: drafts a round; alpha: accepted / judged drafts; draft_cost_ratio: a draft step over a verify."""
        emitted = sum((i + 1) * c for i, c in enumerate(self.counts))
        return dict(accept_counts=self.counts, speculate_k=self.speculate_k,
                    mean_accepted=emitted / max(sum(self.counts), 1),
                    mean_drafted=self.drafted / max(self.rounds, 1),
                    alpha=self.accepted / max(self.tried, 1), draft_step_s=self.draft_s / max(self.drafted, 1),
                    draft_cost_ratio=(self.draft_s / max(self.drafted, 1)) / (self.verify_s / rounds)
                    if rounds else 0.0,
                    verify_s_per_round=self.verify_s / max(rounds, 1))


def right_padded(prompts, device):
    """Prompts of ragged lengths as [B, T] tokens and positions, each row padded at the positions it will decode
    into next (so padding is overwritten before it is seen), and their lengths."""
    if min(len(p) for p in prompts) == 0:
        raise InputError("empty prompt: give at least one token")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    return tokens, torch.arange(tokens.shape[1], device=device).expand_as(tokens).contiguous(), lengths


def decode_chunk(model, steps, token, pos, active, n, sampling):
    """n plain decode steps, one host sync: -> (the last tokens, each row's n new tokens)."""
    produced = []
    for _ in range(n):
        token = steps.decode(model, token, pos, *sampling)
        pos += active
        produced.append(token)
    return token, torch.stack(produced, 1).tolist()


def extend_rows(outputs, histories, new, done, eos_ids, max_new_tokens):
    """Append each running row's new tokens up to its first EOS (kept) or its max_new_tokens, where it is done."""
    for b, tokens in enumerate(new):
        if done[b]:
            continue
        histories[b] += tokens
        for t in tokens:
            outputs[b].append(t)
            if t in eos_ids or len(outputs[b]) == max_new_tokens:
                done[b] = True
                break


@keeps_thread_count
@torch.inference_mode()  # no autograd bookkeeping on any op (a step is faster than under no_grad)
def generate(model, prompts: list[list[int]], max_new_tokens: int, steps: Steps, temperature=0.0, top_k=None,
             top_p=None, eos_ids=(), on_token=None, drafter=None, speculate_k=5, sync_every=None, cached=0,
             request=None):
    """Generate for a batch of prompts (ragged lengths allowed). Returns (new tokens per row, stats).

    cached: the first `cached` tokens of every prompt are in the model's KV cache (and a model drafter's) from the
    previous call on the same rows, a chat's earlier turns: prefill feeds the rest (stats["prefilled"] says how many
    positions from where). Each row runs at its own positions and stops at its first EOS (kept in its output) or at
    max_new_tokens; the batch stops when every row has. `on_token(tokens)` gets each step's host token ids for row 0.
    With a `drafter` (speculative.py), each step is a speculative round of speculate_k drafts (an int, or "auto":
    chosen online by speculative.AdaptiveK; the request's plan refuses a verify the backend does not compute
    exactly). Where the results do not depend on the thread count (sizes_threads), the loop's threads follow the
    cores other processes leave free (ThreadSizer); stats["threads"] is how many it ended with. Plain decoding looks
    at its tokens on the host every `sync_every` steps (default: 8 on CUDA, where each look waits for the GPU; 1
    elsewhere): tokens a row decodes past its end are dropped. `request`: the request's plan where the caller made it
    (generate.py does, before loading: plan()), else it is made here; either way held to the backend's report."""
    device = model.tok_embeddings.weight.device
    sync_every, sampling = sync_every or (8 if device.type == "cuda" else 1), (temperature, top_k, top_p)
    tokens, input_pos, lengths = right_padded(prompts, device)
    if not 0 <= cached < min(lengths.tolist()):
        raise ValueError(f"cached={cached}: prefill needs at least the newest token of every prompt")
    if request is None:
        request = plan(model.args, tokens.shape[1], max_new_tokens, speculate_k if drafter else None)
    request = request.within(report(model).max_verify_tokens)
    length = DraftLength(request.k_max) if drafter and speculate_k == "auto" else None
    cache_len = max(model.max_seq_len, request.cache_len)
    model.setup_caches(len(prompts), cache_len)
    t0 = time.perf_counter()
    token = steps.prefill(model, tokens[:, cached:], input_pos[:, cached:], (lengths - 1 - cached)[:, None], *sampling)
    if drafter:
        drafter.prefill(tokens, input_pos, cache_len, cached, sampling)
    outputs = [[t] for t in token.tolist()]
    stats = {"prefill_s": time.perf_counter() - t0, "prefilled": (cached, tokens.shape[1])}
    done = [t in eos_ids or max_new_tokens == 1 for t in token.tolist()]
    if on_token:
        on_token(outputs[0][:])
    pos = lengths.clone()  # position of each row's newest token, not yet in the cache
    histories = [list(p) + o for p, o in zip(prompts, outputs)]
    rounds, tally = 0, Acceptance(request.k_max, speculate_k)
    sizer = ThreadSizer() if sizes_threads(model, drafter) else NoSizer()
    while not all(done):
        active = torch.tensor([not d for d in done], device=device)
        room = [max_new_tokens - len(o) for o, d in zip(outputs, done) if not d]
        if drafter is None:  # no row may pass its max_new_tokens (nor the cache)
            token, new = decode_chunk(model, steps, token, pos, active, min(sync_every, min(room)), sampling)
            rounds += len(new[0])
        else:
            drafts = min(request.k_max, max(room) - 1)  # a last round drafts only what its longest row can emit
            if length:  # every rank drafts as far: the threshold (from timings) is rank 0's
                length.set_threshold(ranks.from_rank0(length.start([not d for d in done], drafts)))
            draft, n, next_token, timing, drafted = speculative_decode(
                model, drafter, histories, pos, steps.verify, *sampling, drafts=drafts,
                pad_to=1 if length else request.k_max, more=length.more if length else None)
            new = [d[:m] + [t] for d, m, t in zip(draft.tolist(), n.tolist(), next_token.tolist())]
            tally.add(drafted, n.tolist(), done, timing, whole=bool(length) or drafted == request.k_max)
            if length:
                length.update(n.tolist(), [not d for d in done], *timing)
            pos += (n + 1) * active  # a finished row stays where it is
            rounds += 1
        shown = len(outputs[0])
        extend_rows(outputs, histories, new, done, eos_ids, max_new_tokens)
        if drafter is not None:  # (plain decoding feeds its last step's tokens: a finished row's are not read)
            token = torch.tensor([h[-1] for h in histories], device=device)
        if on_token and len(outputs[0]) > shown:
            on_token(outputs[0][shown:])
        sizer()
    stats.update(total_s=time.perf_counter() - t0, decode_steps=rounds, threads=sizer.threads)
    return outputs, stats | (tally.stats(rounds) if drafter else {})


# ---------------------------------------------------------------- the loop's threads

class ThreadSizer:
    """Sizes a decode loop's CPU threads to the cores other processes leave free, from its start to its end.

    Threads that split every product and then wait for each other lose their turns to any other busy process (the
    collapse it avoids is measured in docs/how-it-works.md). At the start it counts the other processes' tasks that
    are running or waiting to (/proc/stat's procs_running less its own running threads, the least of three looks)
    and gives each a core. Then every ~0.1 s it reads how busy its CPUs were less its own CPU time (its own spinning
    threads are its own); it runs one thread fewer while the others take more than 0.3 of a core beyond what it
    leaves them, and one more once they take less than 0.2 of the last one it gave up. Used only where results do
    not depend on the thread count (backend.Report.sizes_threads). A no-op without /proc (not Linux) or on one
    thread. decoding.generate restores the thread count it found (keeps_thread_count)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, interval=0.1):
        self.most = self.threads = torch.get_num_threads()
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.spare = max(len(self.cpus) - self.most, 0)  # cores the others may take without slowing us
        self.interval = interval
        self.last = self.sample() if self.most > 1 else None
        if self.last is not None and len(self.cpus) == os.cpu_count():  # procs_running counts every CPU's tasks
            self.threads = max(1, self.most - max(0, min(self.others_running() for _ in range(3)) - self.spare))
            torch.set_num_threads(self.threads)

    def sample(self):
        """(now, CPU seconds the CPUs we may run on were busy, this process's CPU seconds), or None."""
        busy = 0
        try:
            with open("/proc/stat") as f:
                for line in f:
                    name, *ticks = line.split()
                    if name.startswith("cpu") and name != "cpu" and int(name[3:]) in self.cpus:
                        user, nice, system, _, _, irq, softirq, steal = map(int, ticks[:8])
                        busy += user + nice + system + irq + softirq + steal
        except (OSError, ValueError):
            return None
        return time.monotonic(), busy / self.TICK, time.process_time()

    @staticmethod
    def others_running() -> int:
        """Tasks of other processes running or waiting to run now, in 0.5 ms (so a task passing by is missed)."""
        time.sleep(0.0005)
        try:
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
            ours = 0
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/stat") as f:
                    ours += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, ValueError, StopIteration):
            return 0
        return running - ours

    def __call__(self):
        if self.last is None or time.monotonic() - self.last[0] < self.interval:
            return
        sample = self.sample()
        if sample is None:
            self.last = None
            return
        wall, busy, ours = (b - a for a, b in zip(self.last, sample))
        self.last = sample
        threads = self.resized(self.threads, self.most, (busy - ours) / wall - self.spare)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)

    @staticmethod
    def resized(threads: int, most: int, taken: float) -> int:
        """The thread count after a look that found the others taking `taken` cores of the ones we run on."""
        given = most - threads
        if taken > given + 0.3 and threads > 1:
            return threads - 1
        if taken < given - 0.8 and threads < most:
            return threads + 1
        return threads
