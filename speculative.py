"""Speculative decoding: drafters, the acceptance rule, and one round of `speculative_decode`.

A round: the drafter proposes K tokens and the distributions q they were drawn from (None when the drafter is
deterministic: q is then one-hot); the target scores [last, d1..dK] in one forward (the verify step); the
modified rejection rule accepts a prefix and draws one more token, so every round emits 1..K+1 tokens and the
output is distributed exactly as plain decoding from the target (Leviathan et al. 2023, Chen et al. 2023).
"""
import bisect
import time

import torch

from backend import LONGEST_VERIFY

# ---------------------------------------------------------------- from logits to tokens: temperature, top-k and top-p,
# greedy or a draw, with no host synchronization

def argmax(logits):
    """logits.argmax(-1) by max(-1): the same index (the first largest; NaN counts as largest), where on CPU the
    bf16 argmax over SmolLM2's 49152 logits took 158 us a row and max 31 (Zen 5)."""
    return logits.max(-1).indices


def logits_to_probs(logits, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """The distribution tokens are sampled from: temperature, then top-k, then top-p (nucleus)."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(logits, temperature: float = 0.0, top_k=None, top_p=None):
    """[..., V] logits -> [...] token ids. Greedy at temperature 0; no host synchronization either way."""
    if temperature == 0:
        return argmax(logits)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    # argmax(p / E) with E ~ Exponential(1) draws from p (the exponential race); needs no host sync.
    return argmax(probs / torch.empty_like(probs).exponential_(1))


# ---------------------------------------------------------------- compiled steps

def compile_options(device, same_rows=True) -> dict:
    """torch.compile options of every step (decoding.step, the draft's step): see decoding.step. On CUDA also CUDA
    graphs, and for a draft's steps (same_rows=False) coordinate-descent tuning, which lets Inductor fuse int8's cast
    into the product (without it aten.mm reads a bf16 copy of each weight written by a separate kernel; gpt-fast
    sets it too) but rewrites one-row products only, as a sum of products (torch/_inductor/decomposition.py): a
    target's decode and verify would then compute a row differently (gpu.exact_verify_tokens). On the CPU the glue
    between the ops runs on one thread: a step's few rows of it take less than waking the others (SmolLM2: 1.6 ms of
    a 6.4 ms step in OpenMP's parallel regions); the ops and products use every core."""
    cuda = torch.device(device).type == "cuda"
    return {"triton.cudagraphs": cuda, "coordinate_descent_tuning": cuda and not same_rows, "size_asserts": False,
            "alignment_asserts": False, "emulate_precision_casts": True, "guard_filter_fn": step_guards,
            **({} if cuda else {"cpp.threads": 1})}


def step_guards(entries) -> list[bool]:
    """The guards a compiled step keeps: all but those on its modules' weights and hook dicts, which nothing changes
    under a loaded model (checking them cost 0.6 ms of SmolLM2's 7.6 ms step). The KV caches and rotary tables keep
    theirs: setup_caches may reallocate them, and a new shape compiles anew."""
    return [not (e.orig_guard.source.is_unspecialized_nn_module() and (
        e.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT" or e.guard_type == "TENSOR_MATCH" and not any(
            part in e.name for part in ("k_cache", "v_cache", "rope_cos", "rope_sin")))) for e in entries]


# Dynamo's settings while a step runs (and compiles): a float a model reads (a norm's eps) stays a constant, as the ops
# take it, even where another model's eps met the same code before (Dynamo would make it symbolic); and more than 8
# graphs a step (batch sizes, cache lengths, a draft's two shapes, the models of one process) are compiled, not refused.
STEP_CONFIG = dict(specialize_float=True, recompile_limit=64)


def compile_step(fn, device, same_rows=True, **kwargs):
    """torch.compile(fn) with compile_options, run under STEP_CONFIG. On CUDA the outputs are cloned: the next replay
    of a CUDA graph overwrites the outputs of the last one, and a caller keeps them across steps (a draft's K
    tokens)."""
    step = torch._dynamo.config.patch(**STEP_CONFIG)(
        torch.compile(fn, fullgraph=True, options=compile_options(device, same_rows), **kwargs))
    if torch.device(device).type != "cuda":
        return step

    def cloned(*args):
        out = step(*args)
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out) if isinstance(out, tuple) \
            else out.clone()
    return cloned


def accept(draft, q, p, u, noise):
    """The acceptance rule, a pure function.

    draft [B, K] proposed tokens; q [B, K, V] the distributions they were drawn from, or None (one-hot);
    p [B, K+1, V] target distributions (already warped by temperature / top-k / top-p, like q);
    u [B, K] uniform in [0, 1); noise [B, V] Exponential(1). Returns (n accepted [B], next token [B]).
    """
    B, K = draft.shape
    p_of_draft = p[:, :K].gather(-1, draft[..., None])[..., 0]
    q_of_draft = torch.ones_like(p_of_draft) if q is None else q.gather(-1, draft[..., None])[..., 0]
    accepted = u < p_of_draft / q_of_draft  # strict: a token with p = 0 is never accepted, even at u = 0
    n = accepted.long().cumprod(-1).sum(-1)  # the accepted prefix
    rows = torch.arange(B, device=draft.device)
    p_next = p[rows, n]
    rejected = n < K
    drafted = draft[rows, n.clamp(max=K - 1)]
    if q is None:
        q_next = torch.nn.functional.one_hot(drafted, p.shape[-1]).to(p.dtype)
    else:
        q_next = q[rows, n.clamp(max=K - 1)]
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_min(0), p_next)
    # p == q leaves no residual mass; rejection then had probability 0, so this only guards rounding.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return n, argmax(residual / noise)  # exponential race: samples residual / sum(residual)


def forward(model, tokens, input_pos):
    """The target's forward over a verify's [last, d1..dK]: what a compiled verify compiles (the acceptance after it,
    a few small ops, runs as it is: compiled with it, a second K made Inductor fail on the layers' shared graph, torch
    2.13's 'expected [s12] to have been codegen-ed', where draft and tokens tie two sizes together)."""
    return model(tokens, input_pos)


def any_length(compiled_forward):
    """A compiled forward for verifies of any length: one graph, made at the first call."""
    def forward_step(model, tokens, input_pos):
        torch._dynamo.maybe_mark_dynamic(tokens, 1)
        torch._dynamo.maybe_mark_dynamic(input_pos, 1)
        return compiled_forward(model, tokens, input_pos)
    return forward_step


def verify(forward_step, model, tokens, input_pos, draft, q, u, noise, temperature, top_k, top_p):
    """forward_step(model, tokens, input_pos) (forward, compiled or not) over [last, d1..dK], then the acceptance
    rule."""
    logits = forward_step(model, tokens, input_pos)
    if temperature == 0:
        # accept() with one-hot p and q, without building [B, K+1, V] one-hots (a vocabulary-sized tensor a row):
        # the prefix where the draft is the argmax, then the argmax after it.
        best = argmax(logits)
        n = (draft == best[:, :-1]).long().cumprod(-1).sum(-1)
        return n, best.gather(1, n[:, None])[:, 0]
    return accept(draft, q, logits_to_probs(logits, temperature, top_k, top_p), u, noise)


def ranked_vocabulary(tokenizer, vocab_size: int) -> tuple[torch.Tensor, str]:
    """Every token id [vocab_size], the likeliest first, from text every machine has: the special tokens (ending a
    turn is the draft's to propose), then the tokens of this Python's standard library source (its modules, not
    their tests: code, docstrings, comments) by count, then the rest by id (a BPE vocabulary's merge order).
    -> (ids, what was counted, in words)"""
    import sys
    import sysconfig
    from pathlib import Path
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    texts = [p.read_text(errors="replace") for p in files]
    ids = torch.tensor([i for row in tokenizer.encode_texts(texts) for i in row], dtype=torch.long)
    counts = torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    special = sorted(i for i in tokenizer.special_ids | tokenizer.eos_ids if i < vocab_size)
    counts[special] = counts.sum() + 1
    version = ".".join(map(str, sys.version_info[:3]))
    return torch.argsort(-counts, stable=True), (f"the tokens of CPython {version}'s standard library, {len(files)} "
                                                 f"files, {len(ids)} tokens")


class ModelDrafter:
    """A separate (smaller, or quantized) model proposes tokens with its own static KV cache.

    A row whose drafts were all accepted lacks the KV of its last draft, which the draft never fed itself. The
    round after that starts with a 2-token step over [the token before `last`, last] for every row: it writes
    the missing entry, and rewrites an identical one in the other rows. So no row needs special handling and
    the draft has two static shapes (2 and 1 tokens); rounds with no catching up pay for one token, not two.
    Each shape has its own static compiled graph (one graph dynamic in the token count made 1-token steps slower:
    docs/how-it-works.md).

    vocabulary: the token ids [N] of the draft's LM head rows where its head was trimmed to the likeliest tokens
    (loading.load_draft): a step then reads N rows of the head, not the whole vocabulary's, and proposes among them
    only. A token outside them is never drafted (its q is 0); the target still emits it, so the output is unchanged.
    """

    def __init__(self, model, compile=False, form=None, vocabulary=None):
        self.model = model
        self.form = form  # what the draft runs as, for the report: "int4 (FILE)", "bf16", ...
        self.vocabulary = vocabulary
        self.cached_until = None
        self.step = self._step
        if compile:
            # a static graph for each of the two shapes, 1 and 2 tokens a row; its bits never touch exactness
            self.step = compile_step(self._step, model.tok_embeddings.weight.device, same_rows=False, dynamic=False)

    @staticmethod
    def _step(model, tokens, input_pos, vocabulary, temperature, top_k, top_p):
        """-> (each row's draft [B], the distribution it was drawn from over the whole vocabulary [B, V] or None when
        greedy, the draft's probability of it [B]: how sure the draft is)."""
        logits = model(tokens, input_pos)[:, -1]
        if temperature == 0:
            index, sure = argmax(logits), logits.float().softmax(-1).max(-1).values
            return index if vocabulary is None else vocabulary[index], None, sure
        q = logits_to_probs(logits, temperature, top_k, top_p)
        index = argmax(q / torch.empty_like(q).exponential_(1))
        sure = q.gather(-1, index[:, None])[:, 0]
        if vocabulary is not None:
            index = vocabulary[index]
            q = q.new_zeros(q.shape[0], model.tok_embeddings.num_embeddings).index_copy_(-1, vocabulary, q)
        return index, q, sure

    def prefill(self, tokens, input_pos, cache_len, cached=0, sampling=(0.0, None, None)):
        """Cache the prompts [B, T] from position `cached` on (the target holds the first `cached` from an earlier
        call), or from where this draft's own cache stops being valid, if that is earlier. sampling: the request's
        (temperature, top_k, top_p)."""
        if cached and self.cached_until is not None:  # the last round fed positions up to cached_until - 1 only
            cached = min(cached, int(self.cached_until.min()))
        self.model.setup_caches(tokens.shape[0], cache_len)
        self.model(tokens[:, cached:], input_pos[:, cached:], input_pos[:, -1:] * 0)  # only the KV cache matters
        self.cached_until = None  # each row's prompt is cached; the next round needs no catching up
        if self.step is not self._step and tokens.shape[1] - cached >= 2:
            # a catch-up step over the prompt's last two positions (they get the same entries, or are padding that
            # is overwritten before it is seen): its graph compiles here, not inside a decode
            self.step(self.model, tokens[:, -2:], input_pos[:, -2:], self.vocabulary, *sampling)

    def propose(self, histories, pos, k, temperature, top_k, top_p, more=None):
        """At most k drafts a row, [B, n], and their q [B, n, V] (None when greedy); more(sure [B]) after each draft
        step says whether to draft another (None: all k)."""
        device = pos.device
        catch_up = self.cached_until is not None and bool((pos > self.cached_until).any())
        n = 2 if catch_up else 1
        token = torch.tensor([h[-n:] for h in histories], device=device)
        positions = pos[:, None] + torch.arange(1 - n, 1, device=device)
        tokens, qs = [], []
        for i in range(k):
            token, q, sure = self.step(self.model, token, positions, self.vocabulary, temperature, top_k, top_p)
            tokens.append(token)
            qs.append(q)
            stop = more is not None and not more(sure)
            if stop or i + 1 == k:
                break
            token, positions = token[:, None], (pos + i + 1)[:, None]
        self.cached_until = pos + len(tokens)  # this round fed positions pos .. pos + n - 1
        return torch.stack(tokens, 1), None if temperature == 0 else torch.stack(qs, 1)


class NgramDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the longest suffix n-gram (n <= max_ngram)."""

    def __init__(self, max_ngram=3):
        self.max_ngram = max_ngram

    def prefill(self, tokens, input_pos, cache_len, cached=0, sampling=None):
        pass

    def propose(self, histories, pos, k, temperature, top_k, top_p, more=None):
        """k drafts a row, or fewer where more(None) (they have no probability of their own) says stop."""
        proposals = []
        for h in histories:
            continuation = []
            for n in range(min(self.max_ngram, len(h) - 1), 0, -1):
                suffix = h[-n:]
                for start in range(len(h) - n - 1, -1, -1):
                    if h[start:start + n] == suffix:
                        continuation = h[start + n:start + n + k]
                        break
                if continuation:
                    break
            continuation = (continuation or [h[-1]]) + [h[-1]] * k  # fixed shape: pad with the last token
            proposals.append(continuation[:k])
        n = 0
        while n < k:
            n += 1
            if more is not None and not more(None):
                break
        return torch.tensor(proposals, device=pos.device)[:, :n], None  # deterministic: q is one-hot


def expected_speedup(alpha: float, c: float, k: int) -> float:
    """Tokens per round over the round's cost in target steps: (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    alpha = min(max(alpha, 1e-3), 1 - 1e-3)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


class Seconds:
    """A running estimate of how long something takes that outliers (a compile, a first call, a busy host) cannot
    pull far: a reading counts at most twice the estimate, one below it moves it more than one above, and one below
    half of it replaces it (the estimate came from an outlier)."""

    def __init__(self):
        self.value, self.count = None, 0

    def add(self, seconds: float) -> float:
        """-> the reading as counted."""
        self.count += 1
        if self.value is None or seconds < self.value / 2:
            self.value = seconds
            return seconds
        seconds = min(seconds, 2 * self.value)
        self.value += (seconds - self.value) * (0.5 if seconds < self.value else 0.1)
        return seconds


class DraftLength:
    """--speculate_k auto: a round drafts while the draft is sure. After each draft step, each row's chance that all
    its drafts so far are accepted is the product of their chances, each read off the draft's own probability of its
    token by a calibration the rounds teach (judged drafts counted in bins of that probability); the round drafts one
    more while those chances times the next draft's (learned the same way from the last one's probability), summed
    over the rows, are worth at least `threshold`: the tokens a second the rounds give times what one more draft
    costs (a draft step and a verify row, both measured).
    That is the marginal rule for the most tokens a second, and it stops at the first draft the draft is unsure of. At
    most k_max drafts a round. (The rounds: speculative_decode; the verify then covers only what was drafted.)"""

    EDGES = (0.0, 0.2, 0.4, 0.55, 0.7, 0.8, 0.88, 0.94, 0.97, 0.99, 0.998, 1.0)  # bins of the draft's probability
    FORGET = 64  # rounds after which a verify length not seen again leaves the cost line

    def __init__(self, k_max=LONGEST_VERIFY - 1, decay=0.98, first=4):
        self.k_max, self.decay, self.first = k_max, decay, first
        # the prior: a draft of probability p is accepted with chance p (one of unknown probability: 1/2), worth two
        # judged drafts a bin; and the draft after it, as likely as it
        bins = len(self.EDGES) - 1 + LONGEST_VERIFY
        self.judged, self.after_judged = [2.0] * bins, [2.0] * bins
        self.accepted = [(a + b) for a, b in zip(self.EDGES, self.EDGES[1:])] + [1.0] * LONGEST_VERIFY
        self.after_accepted = list(self.accepted)
        self.step = Seconds()  # a draft step
        self.verify = {}  # drafts -> Seconds of a verify of that many
        self.rounds, self.last_seen = 0, {}  # rounds updated; drafts -> the round its verify was last timed
        self.emitted = [0.0, 0.0]  # decayed sums: tokens emitted, seconds (as counted)
        self.threshold, self.chains, self.sure = None, None, []

    def bin(self, sure: float | None, i: int) -> int:
        """The bin of the i-th draft (from 0) of a round, of the draft's probability `sure`; None (unknown, as an
        n-gram's): a bin by i, after those of the probabilities (an n-gram's drafts are accepted together or not)."""
        if sure is None:
            return len(self.EDGES) - 1 + min(i, LONGEST_VERIFY - 1)
        return min(bisect.bisect_right(self.EDGES, sure) - 1, len(self.EDGES) - 2)

    def chance(self, sure: float | None, i: int) -> float:
        """The chance that the i-th draft of a round, of the draft's probability `sure`, is accepted where the ones
        before it were."""
        b = self.bin(sure, i)
        return self.accepted[b] / self.judged[b]

    def chance_after(self, sure: float | None, i: int) -> float:
        """The chance that the draft after the i-th, which had the draft's probability `sure`, is accepted where the
        ones before it were (a draft sure of one token is often sure of the next)."""
        b = self.bin(sure, i)
        return self.after_accepted[b] / self.after_judged[b]

    def per_draft(self) -> float:
        """What a verify costs a draft more: the slope of a line through the verifies' times by drafts (each length
        weighing as often as it was seen, up to 8), at least 1% of a verify; 10% of one while a single length was
        seen. Only lengths verified in the last FORGET rounds count: one timed once, in a compile or on a busy host,
        and never drafted since would otherwise hold the slope where it put it."""
        recent = [n for n, last in self.last_seen.items() if self.rounds - last < self.FORGET]
        points = [(n, self.verify[n].value, min(self.verify[n].count, 8)) for n in recent]
        w = sum(c for _, _, c in points)
        mean_n, mean_t = (sum(n * c for n, _, c in points) / w, sum(t * c for _, t, c in points) / w)
        spread = sum(c * (n - mean_n) ** 2 for n, _, c in points)
        slope = sum(c * (n - mean_n) * (t - mean_t) for n, t, c in points) / spread if spread else 0.1 * mean_t
        return max(slope, 0.01 * mean_t)

    def start(self, running: list[bool], k_max: int) -> float | None:
        """A round begins that may draft at most k_max, its rows running or not: -> the threshold it follows (None:
        the first round, before anything was measured, drafts `first`), which a tensor-parallel run takes from rank 0
        (set_threshold)."""
        self.round_max, self.chains, self.sure = min(k_max, self.k_max), [float(r) for r in running], []
        if not self.verify or self.step.value is None:
            return None
        return self.emitted[0] / self.emitted[1] * (self.step.value + self.per_draft())

    def set_threshold(self, threshold):
        self.threshold = threshold

    def more(self, sure) -> bool:
        """After a draft step whose drafts have probabilities `sure` [B] under the draft (None: unknown): whether to
        draft another."""
        values = [None] * len(self.chains) if sure is None else sure.tolist()
        self.sure.append(values)
        drafted = len(self.sure)
        self.chains = [p * self.chance(s, drafted - 1) for p, s in zip(self.chains, values)]
        if drafted >= self.round_max:
            return False
        if self.threshold is None:
            return drafted < self.first
        worth = sum(p * self.chance_after(s, drafted - 1) for p, s in zip(self.chains, values))
        return worth >= self.threshold

    def update(self, n_accepted, active, draft_s: float, verify_s: float):
        """After the verify: each row's accepted count (of the round's drafts) and whether it was running, the round's
        seconds drafting and verifying."""
        d = self.decay
        drafts = len(self.sure)
        if drafts == 0:
            return
        for row, (n, running) in enumerate(zip(n_accepted, active)):
            if not running:
                continue
            for i in range(min(n + 1, drafts)):  # drafts past the first rejected one were not judged
                b = self.bin(self.sure[i][row], i)
                self.judged[b], self.accepted[b] = d * self.judged[b] + 1, d * self.accepted[b] + (i < n)
                if 0 < i:  # the draft before it, accepted: what its probability said of this one
                    a = self.bin(self.sure[i - 1][row], i - 1)
                    self.after_judged[a] = d * self.after_judged[a] + 1
                    self.after_accepted[a] = d * self.after_accepted[a] + (i < n)
        seconds = self.step.add(draft_s / drafts) * drafts + self.verify.setdefault(drafts, Seconds()).add(verify_s)
        self.rounds += 1
        self.last_seen[drafts] = self.rounds
        emitted = sum(min(n, drafts) + 1 for n, running in zip(n_accepted, active) if running)
        self.emitted = [d * self.emitted[0] + emitted, d * self.emitted[1] + seconds]


def speculative_decode(model, drafter, histories, pos, verify_step, temperature=0.0, top_k=None, top_p=None,
                       drafts=4, pad_to=None, more=None):
    """One round for a batch. histories: host token lists per row (prompt + generated; the last one is not yet
    in the target's cache, at position pos [B]). The drafter proposes at most `drafts` tokens (fewer where more()
    stops it, or none), padded to pad_to (a fixed K's verify keeps one shape) by repeating the row's last token with
    a one-hot q: padding is a deterministic draft like any other, so the output stays exact. The verify covers the
    drafts and padding. Returns drafts [B, K], n accepted [B], next token [B], the (draft, verify) seconds, from
    which the draft cost ratio c is measured, and how many were drafted (the rest is padding)."""
    t0 = time.perf_counter()
    last = torch.tensor([h[-1] for h in histories], device=pos.device)
    draft, q = last[:, None][:, :0], None  # none to draft: the verify sees only padding
    if drafts:
        draft, q = drafter.propose(histories, pos, drafts, temperature, top_k, top_p, more)
    drafted = draft.shape[1]
    k = max(pad_to or 0, drafted)
    if draft.shape[1] < k:
        pad = last[:, None].expand(-1, k - draft.shape[1])
        if q is not None:
            q = torch.cat([q, torch.nn.functional.one_hot(pad, q.shape[-1]).to(q.dtype)], 1)
        draft = torch.cat([draft, pad], 1)
    draft.tolist()  # host sync, so the timings split draft from verify
    tokens = torch.cat([last[:, None], draft], 1)
    input_pos = pos[:, None] + torch.arange(k + 1, device=pos.device)
    u = noise = None  # greedy acceptance draws nothing
    if temperature != 0:
        u = torch.rand(draft.shape, device=pos.device)
        noise = torch.empty(draft.shape[0], model.args.vocab_size, device=pos.device).exponential_(1)
    t1 = time.perf_counter()
    n, next_token = verify_step(model, tokens, input_pos, draft, q, u, noise, temperature, top_k, top_p)
    n.tolist()
    return draft, n, next_token, (t1 - t0, time.perf_counter() - t1), drafted
