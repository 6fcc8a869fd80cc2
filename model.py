"""Llama-family and CodeGen transformers with a static KV cache.

One forward serves every use: `forward(tokens [B, T], input_pos [B, T])`, with T = 1 (decode), K + 1
(speculative verify) or a whole prompt (prefill). Each batch row carries its own positions; the attention
mask is derived from them, so stale cache slots (padding, rejected draft tokens) are never attended and
are simply overwritten later.

Rotary embeddings use one convention (the first and second half of the rotated dims form the pairs).
Checkpoints stored in the interleaved convention (GGUF, CodeGen) are permuted once at conversion; attention
scores are unchanged by a permutation applied to both q and k.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    """The model's shape and math. config.json must name every field except the last three below, whose absence
    means their neutral value (no rope scaling, the whole head rotates, no q/k/v bias)."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    # "llama": RMSNorm, sequential residual, SwiGLU.  "codegen": LayerNorm, attention and MLP in parallel on
    # one normed input, GELU MLP, biases, LM head with bias.
    family: str = "llama"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # the model's context length
    rope_scaling: dict | None = None  # Llama-3 style: factor, low/high_freq_factor, original_max_position_embeddings
    rotary_dim: int | None = None  # None: the whole head dim rotates
    qkv_bias: bool = False

    OPTIONAL = ("rope_scaling", "rotary_dim", "qkv_bias")  # the fields a config.json may leave out

    def __post_init__(self):
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, n_kv_heads, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        # k, v: [B, T, H_kv, D]; row b writes its T entries at its own positions input_pos[b].
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        return self.k_cache, self.v_cache


def rope_frequencies(args: ModelArgs, device) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], with Llama-3 scaling when configured."""
    r = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r))
    scaling = args.rope_scaling
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


def rope_tables(args: ModelArgs, n_positions: int, device):
    """cos and sin of the rotary angles of positions 0..n_positions-1: [n_positions, rotary_dim / 2] in fp32."""
    angles = torch.outer(torch.arange(n_positions, device=device, dtype=torch.float32), rope_frequencies(args, device))
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin, rotary_dim):
    # x: [B, T, H, D]; cos, sin: [B, T, 1, rotary_dim / 2] in fp32.
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def no_communication(x):
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd, bias = args.head_dim, args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.kv_cache = None
        # Set by tensor parallelism to the heads held by this rank.
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        hd, r = self.args.head_dim, self.args.rotary_dim
        q = apply_rotary(self.wq(x).view(B, T, self.n_heads, hd), cos, sin, r)
        k = apply_rotary(self.wk(x).view(B, T, self.n_kv_heads, hd), cos, sin, r)
        v = self.wv(x).view(B, T, self.n_kv_heads, hd)
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, H_kv, L, D]
        # Grouped-query attention without repeating the cache: the G query heads that share a KV head are
        # folded into the query-length axis, [B, H_kv, G * T, D].
        groups = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2).reshape(B, self.n_kv_heads, groups * T, hd)
        y = self.attend(q, k, v, mask, input_pos)
        y = y.view(B, self.n_heads, T, hd).transpose(1, 2).reshape(B, T, self.n_heads * hd)
        return self.wo(y)

    def attend(self, q, k, v, mask, input_pos):
        """softmax(q k^T / sqrt(D)) v over the cache slots the mask lets each query row see."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.family == "llama"
        bias = args.family == "codegen"
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=bias)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=bias)
        if self.gated:
            self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(args: ModelArgs):
    if args.family == "codegen":
        return nn.LayerNorm(args.dim, eps=args.norm_eps)
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
        # Tensor parallelism (tp.py) makes this an all-reduce: each rank's attention and MLP outputs are then
        # partial sums. CodeGen's parallel branches share one.
        self.reduce = no_communication

    def forward(self, x, cos, sin, mask, input_pos):
        if self.parallel:
            h = self.attention_norm(x)
            return x + self.reduce(self.attention(h, cos, sin, mask, input_pos) + self.feed_forward(h))
        x = x + self.reduce(self.attention(self.attention_norm(x), cos, sin, mask, input_pos))
        return x + self.reduce(self.feed_forward(self.ffn_norm(x)))


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
        for layer in self.layers:
            attn, old = layer.attention, layer.attention.kv_cache
            attn.kv_cache = KVCache(batch_size, max_seq_len, attn.n_kv_heads, self.args.head_dim, dtype, device)
            if old is not None and batch_size == self.max_batch_size:
                attn.kv_cache.k_cache[:, :, :self.max_seq_len] = old.k_cache
                attn.kv_cache.v_cache[:, :, :self.max_seq_len] = old.v_cache
        self.max_batch_size, self.max_seq_len = batch_size, max_seq_len
        cos, sin = rope_tables(self.args, max_seq_len, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, input_pos, logits_idx=None):
        """tokens, input_pos: [B, T]. logits_idx [B, N] (optional): only those positions get logits."""
        cos = self.rope_cos[input_pos].unsqueeze(2)  # [B, T, 1, rotary_dim / 2]
        sin = self.rope_sin[input_pos].unsqueeze(2)
        # [B, 1, T, L]: a query at position p sees cache slots 0..p; repeated for the grouped query heads.
        # L from the cache itself, not from setup_caches: the ONNX export passes caches in as graph inputs.
        attn = self.layers[0].attention  # the heads held here (all of them, unless tensor parallel)
        slots = torch.arange(attn.kv_cache.k_cache.shape[2], device=tokens.device)
        mask = slots <= input_pos[:, None, :, None]
        mask = mask.repeat(1, 1, attn.n_heads // attn.n_kv_heads, 1)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        if logits_idx is not None:
            x = x.gather(1, logits_idx[..., None].expand(-1, -1, x.shape[-1]))
        return self.gather_logits(self.output(self.norm(x)))
