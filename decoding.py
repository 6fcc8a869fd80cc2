"""The decode loop: prefill, the decode and verify steps (torch.compile'd or not), speculative rounds, and the
stats generate.py prints. A model comes from loading.load_model; what its backend did is in backend.report(model).
"""
import functools
import time

import torch

import tp
from backend import report
from checkpoint import InputError
from threads import ThreadSizer
from model import ModelArgs
from sampling import sample
from speculative import AdaptiveK, ModelDrafter, compile_step, speculative_decode, verify

CACHE_ROUNDING = 256  # cache lengths are rounded up so that nearby requests reuse one cache (and one graph)


def prefill(model, tokens, input_pos, logits_idx, temperature, top_k, top_p):
    logits = model(tokens, input_pos, logits_idx)  # [B, 1, V]
    return sample(logits[:, -1], temperature, top_k, top_p)


def decode_one_token(model, token, input_pos, temperature, top_k, top_p):
    logits = model(token[:, None], input_pos[:, None])
    return sample(logits[:, -1], temperature, top_k, top_p)


class Step:
    """A step function (decode, verify), compiled or not: torch.compile(fullgraph=True) with
    speculative.compile_options (no size or alignment asserts: the weights cannot change under a loaded model; every
    16-bit rounding of the eager program kept, so a verify graph rounds as a decode graph does), CUDA graphs on GPU.
    A model whose backend says its steps must not be compiled (backend.Report.compile_steps) runs them as they are."""

    def __init__(self, fn, compile=False, device="cpu"):
        self.fn, self.compiled = fn, None
        if compile:
            self.compiled = compile_step(fn, device)

    def __call__(self, model, *args):
        if self.compiled is None or not report(model).compile_steps:
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


def sizes_threads(model, drafter) -> bool:
    """Whether every model of this loop, the target and a draft model, gives the same results on any thread count
    (backend.Report.sizes_threads), so that the loop may follow the cores other processes leave free."""
    models = [model] + ([drafter.model] if isinstance(drafter, ModelDrafter) else [])
    return all(report(m).sizes_threads for m in models)


class NoSizer:  # the loop runs on the threads it was given
    threads = None

    def __call__(self):
        pass


def check_speculate_k(model, k: int):
    """A verify of K + 1 tokens a row that the model's backend computes as a decode would."""
    limit = report(model).max_verify_tokens
    if limit is not None and k + 1 > limit:
        raise InputError(f"--speculate_k {k}: the {report(model).name} backend verifies at most {limit} tokens a "
                         f"row exactly; use --speculate_k {limit - 1} or less")


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


@keeps_thread_count
@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, steps: Steps, temperature=0.0, top_k=None,
             top_p=None, eos_ids=(), on_token=None, drafter=None, speculate_k=5, sync_every=None, cached=0):
    """Generate for a batch of prompts (ragged lengths allowed). Returns (new tokens per row, stats).

    cached: the first `cached` tokens of every prompt are in the model's KV cache (and a model drafter's) from the
    previous call on the same rows, a chat's earlier turns: prefill feeds the rest (stats["prefilled"] says how many
    positions from where).

    Rows are right-padded; each row runs at its own positions, so padding is never attended and is
    overwritten as the row decodes. A row stops at its first EOS (kept in its output) or at max_new_tokens; the
    batch stops when every row has. `on_token(tokens)` gets each step's host token ids for row 0.
    With a `drafter` (speculative.py), each step is a speculative round of speculate_k drafts (an int, or
    "auto": chosen online by speculative.AdaptiveK); a verify longer than the backend computes exactly
    (backend.Report.max_verify_tokens) is refused. Where the results do not depend on the thread count
    (sizes_threads), the loop's threads follow the cores other processes leave free (ThreadSizer); stats["threads"]
    is how many it ended with. Plain decoding looks at its tokens on the host every `sync_every` steps (default: 8 on CUDA, where
    each look waits for the GPU; 1 elsewhere): a row that ends within those steps has decoded past its end, and
    those tokens are dropped.
    """
    limit = report(model).max_verify_tokens
    adaptive = AdaptiveK(k_max=limit - 1 if limit else None) if speculate_k == "auto" else None
    device = model.tok_embeddings.weight.device
    sync_every = sync_every or (8 if device.type == "cuda" else 1)
    B = len(prompts)
    if min(len(p) for p in prompts) == 0:
        raise InputError("empty prompt: give at least one token")
    if not 0 <= cached < min(len(p) for p in prompts):
        raise ValueError(f"cached={cached}: prefill needs at least the newest token of every prompt")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    k_max = adaptive.k_max if adaptive else speculate_k
    if drafter:
        check_speculate_k(model, k_max)
    spare = spare_positions(drafter, speculate_k)
    cache_len = max(model.max_seq_len, cache_length(T, max_new_tokens, model.args, spare))
    model.setup_caches(B, cache_len)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    # Padding sits at the positions the row will decode into next, so it is overwritten before it is seen.
    input_pos = torch.arange(T, device=device).expand(B, T).contiguous()
    t0 = time.perf_counter()
    token = steps.prefill(model, tokens[:, cached:], input_pos[:, cached:], (lengths - 1 - cached)[:, None],
                          temperature, top_k, top_p)
    if drafter:
        drafter.prefill(tokens, input_pos, cache_len, cached)
    outputs = [[t] for t in token.tolist()]
    stats = {"prefill_s": time.perf_counter() - t0, "prefilled": (cached, T)}
    done = [t in eos_ids or max_new_tokens == 1 for t in token.tolist()]
    if on_token:
        on_token(outputs[0][:])
    pos = lengths.clone()  # position of each row's newest token, not yet in the cache
    histories = [list(p) + o for p, o in zip(prompts, outputs)]
    rounds, accept_counts, ks = 0, [0] * (k_max + 1), []
    draft_s = verify_s = 0.0
    drafted = tried = accepted = 0  # draft tokens proposed, judged, accepted
    sizer = ThreadSizer() if sizes_threads(model, drafter) else NoSizer()
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

