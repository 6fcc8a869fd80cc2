"""Speculative decoding: drafters, the acceptance rule, and one round of `speculative_decode`.

A round: the drafter proposes K tokens and the distributions q they were drawn from (None when the drafter is
deterministic: q is then one-hot); the target scores [last, d1..dK] in one forward (the verify step); the
modified rejection rule accepts a prefix and draws one more token, so every round emits 1..K+1 tokens and the
output is distributed exactly as plain decoding from the target (Leviathan et al. 2023, Chen et al. 2023).
"""
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


class ModelDrafter:
    """A separate (smaller, or quantized) model proposes tokens with its own static KV cache.

    A row whose drafts were all accepted lacks the KV of its last draft, which the draft never fed itself. The
    round after that starts with a 2-token step over [the token before `last`, last] for every row: it writes
    the missing entry, and rewrites an identical one in the other rows. So no row needs special handling and
    the draft has two static shapes (2 and 1 tokens); rounds with no catching up pay for one token, not two.
    Each shape has its own static compiled graph (one graph dynamic in the token count made 1-token steps slower:
    docs/how-it-works.md).
    """

    def __init__(self, model, compile=False, form=None):
        self.model = model
        self.form = form  # what the draft runs as, for the report: "int4 (FILE)", "bf16", ...
        self.cached_until = None
        self.step = self._step
        if compile:
            # a static graph for each of the two shapes, 1 and 2 tokens a row; its bits never touch exactness
            self.step = compile_step(self._step, model.tok_embeddings.weight.device, same_rows=False, dynamic=False)

    @staticmethod
    def _step(model, tokens, input_pos, temperature, top_k, top_p):
        logits = model(tokens, input_pos)[:, -1]
        if temperature == 0:
            return argmax(logits), None
        q = logits_to_probs(logits, temperature, top_k, top_p)
        return argmax(q / torch.empty_like(q).exponential_(1)), q

    def prefill(self, tokens, input_pos, cache_len, cached=0):
        """Cache the prompts [B, T] from position `cached` on (the target holds the first `cached` from an earlier
        call), or from where this draft's own cache stops being valid, if that is earlier."""
        if cached and self.cached_until is not None:  # the last round fed positions up to cached_until - 1 only
            cached = min(cached, int(self.cached_until.min()))
        self.model.setup_caches(tokens.shape[0], cache_len)
        self.model(tokens[:, cached:], input_pos[:, cached:], input_pos[:, -1:] * 0)  # only the KV cache matters
        self.cached_until = None  # each row's prompt is cached; the next round needs no catching up

    def propose(self, histories, pos, k, temperature, top_k, top_p):
        device = pos.device
        catch_up = self.cached_until is not None and bool((pos > self.cached_until).any())
        n = 2 if catch_up else 1
        first = torch.tensor([h[-n:] for h in histories], device=device)
        positions = pos[:, None] + torch.arange(1 - n, 1, device=device)
        token, q = self.step(self.model, first, positions, temperature, top_k, top_p)
        tokens, qs = [token], [q]
        for i in range(1, k):
            token, q = self.step(self.model, token[:, None], (pos + i)[:, None], temperature, top_k, top_p)
            tokens.append(token)
            qs.append(q)
        self.cached_until = pos + k  # this round fed positions pos .. pos + k - 1
        return torch.stack(tokens, 1), None if temperature == 0 else torch.stack(qs, 1)


class NgramDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the longest suffix n-gram (n <= max_ngram)."""

    def __init__(self, max_ngram=3):
        self.max_ngram = max_ngram

    def prefill(self, tokens, input_pos, cache_len, cached=0):
        pass

    def propose(self, histories, pos, k, temperature, top_k, top_p):
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
        return torch.tensor(proposals, device=pos.device), None  # deterministic: q is one-hot


def expected_speedup(alpha: float, c: float, k: int) -> float:
    """Tokens per round over the round's cost in target steps: (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    alpha = min(max(alpha, 1e-3), 1 - 1e-3)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


class AdaptiveK:
    """--speculate_k auto: every few rounds, step K by one toward the K, among every K the backend verifies exactly
    (up to k_max), that maximizes tokens per second,
    (1 - a^(K+1)) / (1 - a) / (K t_draft + t_verify(K)), from moving averages measured online: alpha (accepted /
    tried drafts), the draft step time, and the verify time at each K tried, fitted by a line in K. With one K
    seen, t_verify is taken as constant and this is expected_speedup with c = t_draft / t_verify. The verify
    time matters: on CPUs a (K+1)-token verify costs up to several decode steps (scripts/bench.py column v).
    Small steps, though compiling is not what they save: the second K seen turns the compiled verify into one
    graph for any K (dynamo's automatic dynamic shapes), and no K after it compiles."""

    k_max = LONGEST_VERIFY - 1  # the most it ever tries; a caller may lower it

    def __init__(self, k=4, every=8, decay=0.8, k_max=None):
        self.k, self.every, self.decay = k, every, decay
        self.k_max = min(self.k_max, k_max or self.k_max)
        self.alpha, self.draft_s, self.verify_s, self.rounds = 0.5, None, {}, 0

    def _ema(self, old, new):
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def verify_time(self, k: int) -> float:
        ks = sorted(self.verify_s)
        if len(ks) == 1:
            return self.verify_s[ks[0]]
        mean_k, mean_t = sum(ks) / len(ks), sum(self.verify_s.values()) / len(ks)
        slope = sum((x - mean_k) * (self.verify_s[x] - mean_t) for x in ks) / sum((x - mean_k) ** 2 for x in ks)
        return max(mean_t + slope * (k - mean_k), 1e-9)

    def tokens_per_second(self, k: int) -> float:
        c = self.draft_s / self.verify_time(k)
        return expected_speedup(self.alpha, c, k) / self.verify_time(k)

    def update(self, accepted: int, tried: int, draft_step_s: float, verify_s: float):
        if tried:
            self.alpha = self._ema(self.alpha, accepted / tried)
        self.draft_s = self._ema(self.draft_s, draft_step_s)
        self.verify_s[self.k] = self._ema(self.verify_s.get(self.k), verify_s)
        self.rounds += 1
        if self.rounds % self.every == 0:
            best = max(range(1, self.k_max + 1), key=self.tokens_per_second)
            self.k += (best > self.k) - (best < self.k)


def speculative_decode(model, drafter, histories, pos, k, verify_step, temperature=0.0, top_k=None, top_p=None,
                       drafts=None):
    """One round for a batch. histories: host token lists per row (prompt + generated; the last one is not yet
    in the target's cache, at position pos [B]). The drafter proposes `drafts` tokens (default k; fewer when no
    row can emit more), padded to the verify's k by repeating the row's last token with a one-hot q: padding is
    a deterministic draft like any other, so the output stays exact. Returns drafts [B, K], n accepted [B], next
    token [B] and the (draft, verify) seconds, from which the draft cost ratio c is measured."""
    t0 = time.perf_counter()
    drafts = k if drafts is None else drafts
    last = torch.tensor([h[-1] for h in histories], device=pos.device)
    draft, q = last[:, None][:, :0], None  # none to draft: the verify sees only padding
    if drafts:
        draft, q = drafter.propose(histories, pos, drafts, temperature, top_k, top_p)
    if drafts < k:
        pad = last[:, None].expand(-1, k - drafts)
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
    return draft, n, next_token, (t1 - t0, time.perf_counter() - t1)
