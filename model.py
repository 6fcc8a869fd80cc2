"""Llama-family, Gemma 3 and CodeGen transformers with a static KV cache.

One forward serves every use: `forward(tokens [B, T], input_pos [B, T])`, with T = 1 (decode), K + 1
(speculative verify) or a whole prompt (prefill). Each batch row carries its own positions, and writes the cache slots
of those numbers unless `slots` says otherwise. What a query row sees of the cache is data the glue computes once a
step (visible_slots: the slots up to its own, so stale slots of padding or rejected drafts are never attended and are
simply overwritten later) and hands to the attention op: a fork's window, sinks or prefix mask is an edit there that
every backend honors.

Rotary embeddings use one convention (the first and second half of the rotated dims form the pairs).
Checkpoints stored in the interleaved convention (GGUF, CodeGen) are permuted once at conversion; attention
scores are unchanged by a permutation applied to both q and k.

The ops model.py calls besides the products (torch.ops.fastdecode.rms_norm, layer_norm, attention) are defined by
their reference, the plain PyTorch of the functions of those names below; a backend registers its kernels for them
per device (cpu/, gpu.py), each held to its reference by the tests and by a spot check when it loads. Every reduction of a step lives inside an op or a product, so the glue between them (what
torch.compile fuses) computes a row of a verify as it computes the row of a decode.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    """The model's shape and math. config.json must name every field but those of OPTIONAL, whose absence means their
    neutral value (no rope scaling, the whole head rotates, no q/k/v bias, heads of dim / n_heads, no q/k norm, scores
    scaled by head_dim^-1/2, every layer full)."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    # "llama": RMSNorm, sequential residual, SwiGLU.  "gemma3": llama's, with tanh-GELU gating, each branch's output
    # RMS-normed too and embeddings scaled by sqrt(dim).  "codegen": LayerNorm, attention and MLP in parallel on
    # one normed input, GELU MLP, biases, LM head with bias.
    family: str = "llama"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # the model's context length
    rope_scaling: dict | None = None  # Llama-3 style: factor, low/high_freq_factor, original_max_position_embeddings
    rotary_dim: int | None = None  # None: the whole head dim rotates
    qkv_bias: bool = False
    head_dim: int | None = None  # None: dim // n_heads (Qwen3's heads are wider: a field of its own)
    qk_norm: bool = False  # each head's q and k RMS-normed before rotary (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (None: head_dim's)
    # per layer "full_attention" or "sliding_attention" (None: all full); a sliding layer's token sees the
    # sliding_window slots up to its own, and rotates with base rope_local_theta (None: rope_theta), unscaled
    layer_types: list | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None

    OPTIONAL = ("rope_scaling", "rotary_dim", "qkv_bias", "head_dim", "qk_norm", "query_pre_attn_scalar",
                "layer_types", "sliding_window", "rope_local_theta")  # what a config.json may leave out

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim

    def layer_kinds(self) -> list:
        """Each layer's kind, "full_attention" or "sliding_attention"."""
        return self.layer_types or ["full_attention"] * self.n_layers


# ---------------------------------------------------------------- the ops, defined by their references

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in float32, rounded to x's dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).contiguous()  # (each op's result is contiguous, as its kernels' and fake's)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """nn.LayerNorm's math, an op so that no compiled step splits its mean and variance another way for another
    number of rows (PyTorch's own kernel computes each row alike)."""
    return F.layer_norm(x, weight.shape, weight, bias, eps).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over the cache slots each row sees. q [B, H_kv, G * T, D]: the G query heads that share
    a KV head folded into the rows, row r being token r % T; k, v [B, H_kv, L, D], the whole cache; visible [B, T, L]
    bools: the slots token t sees (each row sees at least one)."""
    mask = visible[:, None].repeat(1, 1, q.shape[2] // visible.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).contiguous()


# The ops, torch.ops.fastdecode.*: torch.compile sees each as one call (with the shape and the contiguous strides of its
# result), and a backend registers its kernel for it per device.
torch.library.custom_op("fastdecode::rms_norm", rms_norm, mutates_args=()).register_fake(
    lambda x, weight, eps: x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)))
torch.library.custom_op("fastdecode::layer_norm", layer_norm, mutates_args=()).register_fake(
    lambda x, weight, bias, eps: x.new_empty(x.shape))
torch.library.custom_op("fastdecode::attention", attention, mutates_args=()).register_fake(
    lambda q, k, v, visible, scale: q.new_empty(q.shape))


# ---------------------------------------------------------------- the model

class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, n_kv_heads, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots, k, v):
        # k, v: [B, T, H_kv, D]; row b writes its T entries at its own slots[b].
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k_cache[rows, :, slots] = k
        self.v_cache[rows, :, slots] = v
        return self.k_cache, self.v_cache

    def rows(self, first: int, count: int = 1) -> "KVCache":
        """Rows first..first + count - 1 of this cache, sharing its memory: what a step writes there, it writes here."""
        view = KVCache(0, 0, 0, 0, self.k_cache.dtype, self.k_cache.device)
        view.k_cache, view.v_cache = self.k_cache[first:first + count], self.v_cache[first:first + count]
        return view


def rope_frequencies(args: ModelArgs, device, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], with Llama-3 or linear scaling when configured; local: a sliding layer's."""
    r = args.rotary_dim
    theta = (args.rope_local_theta or args.rope_theta) if local else args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r))
    scaling = None if local else args.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        inv_freq = inv_freq / scaling["factor"]
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_tables(args: ModelArgs, n_positions: int, device, local: bool = False):
    """cos and sin of the rotary angles of positions 0..n_positions-1: [n_positions, rotary_dim / 2] in fp32."""
    angles = torch.outer(torch.arange(n_positions, device=device, dtype=torch.float32),
                         rope_frequencies(args, device, local))
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin, rotary_dim):
    # x: [B, T, H, D]; cos, sin: [B, T, 1, rotary_dim / 2] in fp32.
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def visible_slots(slots: torch.Tensor, n_slots: int, window: int | None = None) -> torch.Tensor:
    """What each query row sees of a cache of n_slots: [B, T, n_slots] bools, the slots up to its own (causal), only
    the last `window` of them where a window is given."""
    cache, own = torch.arange(n_slots, device=slots.device), slots[..., None]
    if window is None:
        return cache <= own
    return (cache <= own) & (cache > own - window)


def no_communication(x):
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return torch.ops.fastdecode.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return torch.ops.fastdecode.layer_norm(x, self.weight, self.bias, self.eps)


def stacked(args: ModelArgs) -> dict:
    """The products that read the same input, stacked by output rows into one (a step reads that input once and makes
    one call instead of three): a checkpoint holds them apart, and loading.py stacks them. -> {a stacked product's
    name in a layer: [(the name of a part, its output rows), ...]}"""
    hd = args.head_dim
    return {"attention.wqkv": [("attention.wq", args.n_heads * hd), ("attention.wk", args.n_kv_heads * hd),
                               ("attention.wv", args.n_kv_heads * hd)],
            "feed_forward.w13": [("feed_forward.w1", args.intermediate_size),
                                 ("feed_forward.w3", args.intermediate_size)]}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd, bias=args.qkv_bias)  # q, k, v
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, args.norm_eps), RMSNorm(hd, args.norm_eps)
        self.scale = (args.query_pre_attn_scalar or hd) ** -0.5
        self.kv_cache = None
        # Set by tensor parallelism to the heads held by this rank.
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads

    def forward(self, x, cos, sin, slots, visible):
        B, T, _ = x.shape
        hd, r = self.args.head_dim, self.args.rotary_dim
        qk, v = self.wqkv(x).view(B, T, -1, hd).split([self.n_heads + self.n_kv_heads, self.n_kv_heads], 2)
        if self.args.qk_norm:
            q, k = qk.split([self.n_heads, self.n_kv_heads], 2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], 2)
        # q's and k's heads rotate in one call: the same math in half the small ops (eager)
        q, k = apply_rotary(qk, cos, sin, r).split([self.n_heads, self.n_kv_heads], 2)
        k, v = self.kv_cache.update(slots, k, v)  # [B, H_kv, L, D]
        # Grouped-query attention without repeating the cache: the G query heads that share a KV head are
        # folded into the query-length axis, [B, H_kv, G * T, D].
        groups = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2).reshape(B, self.n_kv_heads, groups * T, hd)
        y = self.attend(q, k, v, visible)
        y = y.view(B, self.n_heads, T, hd).transpose(1, 2).reshape(B, T, self.n_heads * hd)
        return self.wo(y)

    def attend(self, q, k, v, visible):
        """softmax(q k^T * scale) v over the cache slots each query row sees (scale: 1 / sqrt(D) unless configured)."""
        return torch.ops.fastdecode.attention(q, k, v, visible, self.scale)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.family in ("llama", "gemma3")
        self.gate = F.silu if args.family == "llama" else lambda x: F.gelu(x, approximate="tanh")
        if self.gated:
            self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate (w1) and up (w3)
        else:
            self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=True)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=not self.gated)

    def forward(self, x):
        if self.gated:
            gate, up = self.w13(x).chunk(2, -1)
            return self.w2(self.gate(gate) * up)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(args: ModelArgs):
    if args.family == "codegen":
        return LayerNorm(args.dim, eps=args.norm_eps)
    return RMSNorm(args.dim, args.norm_eps)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.parallel = args.family == "codegen"
        self.attention_norm = make_norm(args)
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        if not self.parallel:
            self.ffn_norm = make_norm(args)
        self.sandwich = args.family == "gemma3"  # each branch's output normed before the residual adds it
        if self.sandwich:
            self.post_attention_norm, self.post_ffn_norm = make_norm(args), make_norm(args)
        # Tensor parallelism (tp.py) makes this an all-reduce: each rank's attention and MLP outputs are then
        # partial sums. CodeGen's parallel branches share one.
        self.reduce = no_communication

    # torch.compile traces one layer and runs its graph for every layer (a compile then costs about one layer's)
    @torch.compiler.nested_compile_region
    def forward(self, x, cos, sin, slots, visible):
        if self.parallel:
            h = self.attention_norm(x)
            return x + self.reduce(self.attention(h, cos, sin, slots, visible) + self.feed_forward(h))
        h = self.reduce(self.attention(self.attention_norm(x), cos, sin, slots, visible))
        x = x + (self.post_attention_norm(h) if self.sandwich else h)
        h = self.reduce(self.feed_forward(self.ffn_norm(x)))
        return x + (self.post_ffn_norm(h) if self.sandwich else h)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=args.family == "codegen")
        self.tie_weights()
        self.max_batch_size = self.max_seq_len = 0
        self.gather_logits = no_communication  # tp.py: an all-gather when the LM head is split by vocabulary

    def tie_weights(self):
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, batch_size: int, max_seq_len: int):
        """Allocate the static KV cache once; a request that fits the current cache reuses it, and a longer cache for
        the same batch keeps what the shorter one held (a chat's earlier turns)."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"{max_seq_len} positions requested but the model's context (max_seq_len) is "
                             f"{self.args.max_seq_len}")
        if batch_size == self.max_batch_size and max_seq_len <= self.max_seq_len:
            return
        weight = self.layers[0].attention_norm.weight
        dtype, device = weight.dtype, weight.device
        with torch.inference_mode(False):  # the caches outlive a request: code outside inference mode may write them
            for layer in self.layers:
                attn, old = layer.attention, layer.attention.kv_cache
                attn.kv_cache = KVCache(batch_size, max_seq_len, attn.n_kv_heads, self.args.head_dim, dtype, device)
                if old is not None and batch_size == self.max_batch_size:
                    attn.kv_cache.k_cache[:, :, :self.max_seq_len] = old.k_cache
                    attn.kv_cache.v_cache[:, :, :self.max_seq_len] = old.v_cache
            self.max_batch_size, self.max_seq_len = batch_size, max_seq_len
            self.setup_rope(max_seq_len, device)

    @contextlib.contextmanager
    def cache_rows(self, first: int, count: int = 1):
        """Steps inside run on rows first..first + count - 1 of the batch's cache alone (a server prefills a joining
        request's row while the other rows keep what they hold)."""
        whole = [layer.attention.kv_cache for layer in self.layers]
        try:
            for layer, cache in zip(self.layers, whole):
                layer.attention.kv_cache = cache.rows(first, count)
            yield
        finally:
            for layer, cache in zip(self.layers, whole):
                layer.attention.kv_cache = cache

    def setup_rope(self, n_positions: int, device):
        """The rotary tables of positions 0..n_positions-1 (a sliding layer's too, where the model has them)."""
        cos, sin = rope_tables(self.args, n_positions, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if "sliding_attention" in self.args.layer_kinds():
            cos, sin = rope_tables(self.args, n_positions, device, local=True)
            self.register_buffer("local_rope_cos", cos, persistent=False)
            self.register_buffer("local_rope_sin", sin, persistent=False)

    def forward(self, tokens, input_pos, logits_idx=None, slots=None):
        """tokens, input_pos (rotary positions): [B, T]. logits_idx [B, N] (optional): only those positions get logits.
        slots [B, T] (optional): the cache slots the tokens write, where not their positions."""
        slots = input_pos if slots is None else slots
        n_slots = self.layers[0].attention.kv_cache.k_cache.shape[2]
        # each kind of layer's rotation ([B, T, 1, rotary_dim / 2]) and what its rows see, once a step
        seen = {"full_attention": (self.rope_cos[input_pos].unsqueeze(2), self.rope_sin[input_pos].unsqueeze(2),
                                   visible_slots(slots, n_slots))}
        if "sliding_attention" in self.args.layer_kinds():
            seen["sliding_attention"] = (self.local_rope_cos[input_pos].unsqueeze(2),
                                         self.local_rope_sin[input_pos].unsqueeze(2),
                                         visible_slots(slots, n_slots, self.args.sliding_window))
        x = self.tok_embeddings(tokens)
        if self.args.family == "gemma3":  # the scale rounded to the weights' dtype first, as Gemma's reference does
            x = x * torch.tensor(self.args.dim ** 0.5, dtype=x.dtype, device=x.device)
        for layer, kind in zip(self.layers, self.args.layer_kinds()):
            cos, sin, visible = seen[kind]
            x = layer(x, cos, sin, slots, visible)
        if logits_idx is not None:
            x = x.gather(1, logits_idx[..., None].expand(-1, -1, x.shape[-1]))
        return self.gather_logits(self.output(self.norm(x)))
