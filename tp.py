"""Tensor parallelism on torch.distributed: each rank holds a slice of every layer.

    python generate.py --nproc_per_node N --checkpoint_path CKPT [--draft_checkpoint DRAFT] ...

How the ranks start, join their group and end: ranks.py. This file slices a model for one rank and gives it the
collectives.

Placement (Megatron-LM's). Attention: wqkv keeps the rows of this rank's heads of q, k and v (column parallel), wo
the matching input columns (row parallel); the KV cache holds only this rank's KV heads. MLP: w13 (gate and up) keeps
this rank's rows of each half (column parallel), w2 row parallel. A row-parallel output is a partial sum, so each block half ends in one all-reduce
(`Block.reduce`); CodeGen adds its attention and MLP outputs before the residual, so their partial sums share
one all-reduce per layer. Row-parallel biases are added on rank 0 only. The LM head is split by vocabulary
rows when they divide into multiples of 16 (any kernel takes those) and the logits are all-gathered
(`Transformer.gather_logits`); the embedding table is then split the same way (a tied head stays tied): each
rank looks up the tokens it holds, zeros for the rest, and an all-reduce assembles the rows. Otherwise both
are replicated. So a rank holds ~1/N of every weight but the norms.

Query heads must split evenly. KV heads need not (SmolLM2 has 3): a rank keeps the KV heads its query heads
read, so a KV head shared by two ranks is held by both.

Each weight format slices by its record (quantize.keep_outputs reads the output axis of each of its tensors, its
class's `keep_inputs` the inputs): int8 scales follow their rows; int4 groups and MX blocks run along in_features and a row-parallel split must fall on their boundaries
(and int4 keeps output rows in multiples of 16), else loading stops with an error naming the layer.

Every rank runs the same host loop with the same seed on the same logits (an all-reduce leaves every rank
the same sum, an all-gather the same logits), so all ranks sample the same tokens without a broadcast.

A draft model is replicated, not sharded: it exists to be cheap, and a sharded draft would pay two
all-reduces per layer per drafted token in latency (measured here: ~0.6 ms per gloo all-reduce; ~10-20 us
with NCCL), more than a small draft's compute. The price is the draft's full size on every rank.

Why not `torch.distributed.tensor.parallel`: its Colwise/RowwiseParallel plans shard nn.Linear and
nn.Embedding parameters as DTensors. Our quantized layers keep their weights as buffers in layouts that a
Shard placement does not describe (packed int4 nibbles with [K/g, N, 2] scales, MX codes with per-block
scales), duplicating KV heads is not a placement, and CodeGen's single all-reduce needs the residual added
outside the reduced sum. So this file slices tensors itself and communicates with functional collectives,
which torch.compile traces into the decode graph.
"""
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

import quantize
from checkpoint import InputError
from model import Transformer, no_communication


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def head_plan(n_heads: int, n_kv_heads: int, rank: int, world: int) -> tuple[range, list[int]]:
    """This rank's query heads and the KV heads they read (a KV head may be held by several ranks)."""
    if n_heads % world:
        raise InputError(f"config.json n_heads {n_heads} does not split over {world} ranks; launch with "
                         f"--nproc_per_node one of {divisors(n_heads)}")
    per_rank = n_heads // world
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    read = [h // (n_heads // n_kv_heads) for h in q_heads]  # nondecreasing
    kv_heads = sorted(set(read))
    if any(read.count(h) != per_rank // len(kv_heads) for h in kv_heads) or per_rank % len(kv_heads):
        kv_heads = read  # uneven grouping here: one KV head per query head keeps grouped attention uniform
    return q_heads, kv_heads


def indices(rows) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def rows_of(heads, head_dim):
    """Weight rows of `heads`: a slice (a view of the mapped file) when they are consecutive."""
    if list(heads) == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0] * head_dim, (heads[-1] + 1) * head_dim)
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


class VocabShardEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding table; the other ranks hold the others."""

    def __init__(self, weight, start):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.reduce = no_communication  # apply_tp: all-reduce

    def forward(self, tokens):
        local = tokens - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.reduce(torch.where(held[..., None], rows, 0))  # exact: one rank adds a row, the rest zeros


def check_split(args, world: int):
    """The heads and the MLP split over `world` ranks: checked from config.json before anything loads (a quantized
    layout's blocks are checked as each layer is sliced)."""
    head_plan(args.n_heads, args.n_kv_heads, 0, world)
    mlp_rows(args.intermediate_size, 0, world)


def mlp_rows(intermediate_size: int, rank: int, world: int) -> slice:
    """This rank's MLP rows: an even split where the size divides, else (Qwen2.5-1.5B's 8960 over 3 ranks) whole
    blocks of the largest power of two up to 256 that divides the size, so no quantized block is cut."""
    if intermediate_size % world == 0:
        per_rank = intermediate_size // world
        return slice(rank * per_rank, (rank + 1) * per_rank)
    unit = next(u for u in (256, 128, 64, 32, 16, 8, 4, 2, 1) if intermediate_size % u == 0)
    units = intermediate_size // unit
    if units < world:
        raise InputError(f"config.json intermediate_size {intermediate_size} does not split over {world} ranks; "
                         f"launch with --nproc_per_node at most {units}")
    return slice(rank * units // world * unit, (rank + 1) * units // world * unit)


# ---------------------------------------------------------------- slicing a layer, per type

def parameter(t):
    return nn.Parameter(t.contiguous(), requires_grad=False)


def select_outputs(layer, index):
    """Keep the output rows `index` of a layer (column parallel). Row slices of a mapped file stay views of it."""
    if quantize.format_of(layer) is None:
        raise InputError(f"a {type(layer).__name__} layer cannot be split by tensor parallelism")
    quantize.keep_outputs(layer, index)


def select_inputs(layer, start, stop):
    """Keep the input columns [start, stop) of a layer (row parallel): whole int4 groups and MX blocks only."""
    if isinstance(layer, nn.Linear):
        layer.weight = parameter(layer.weight[:, start:stop])
        layer.in_features = layer.weight.shape[1]
    elif isinstance(layer, quantize.MODULES):
        layer.keep_inputs(start, stop)
    else:
        raise InputError(f"a {type(layer).__name__} layer cannot be split by tensor parallelism")


def shard(model: Transformer, rank: int, world: int) -> bool:
    """Slice the model in place to rank `rank` of `world` (no communication). Returns whether the embedding
    and LM head are split by vocabulary (then embeddings must be all-reduced and logits gathered)."""
    args = model.args
    check_split(args, world)
    q_heads, kv_heads = head_plan(args.n_heads, args.n_kv_heads, rank, world)
    q_rows, kv_rows = rows_of(q_heads, args.head_dim), rows_of(kv_heads, args.head_dim)
    mlp = mlp_rows(args.intermediate_size, rank, world)

    def sliced(name, select, *where):
        try:
            select(*where)
        except InputError as e:  # a quantized layout that does not split here; name the layer
            raise InputError(f"{name}: {e} at {world} ranks; launch with another --nproc_per_node or use another "
                             "quantization mode") from None

    def row_parallel(name, linear, start, stop):
        sliced(name, select_inputs, linear, start, stop)
        if rank:
            linear.bias = None  # added once, by rank 0, into the all-reduced sum

    q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    qkv_rows = torch.cat([indices(q_rows), q_size + indices(kv_rows), q_size + kv_size + indices(kv_rows)])
    for i, layer in enumerate(model.layers):
        attn, ff = layer.attention, layer.feed_forward
        sliced(f"layers.{i}.attention.wqkv", select_outputs, attn.wqkv, qkv_rows)
        row_parallel(f"layers.{i}.attention.wo", attn.wo, q_rows.start, q_rows.stop)
        attn.n_heads, attn.n_kv_heads = len(q_heads), len(kv_heads)
        if ff.gated:  # this rank's rows of the gate, then of the up projection
            rows = torch.cat([indices(mlp), args.intermediate_size + indices(mlp)])
            sliced(f"layers.{i}.feed_forward.w13", select_outputs, ff.w13, rows)
        else:
            sliced(f"layers.{i}.feed_forward.w1", select_outputs, ff.w1, mlp)
        row_parallel(f"layers.{i}.feed_forward.w2", ff.w2, mlp.start, mlp.stop)
    split_vocab = args.vocab_size % (16 * world) == 0
    if split_vocab:
        per_rank = args.vocab_size // world
        vocab_rows = slice(rank * per_rank, (rank + 1) * per_rank)
        model.tok_embeddings = VocabShardEmbedding(model.tok_embeddings.weight[vocab_rows], vocab_rows.start)
        if args.tie_embeddings:
            model.tie_weights()
        else:
            sliced("output", select_outputs, model.output, vocab_rows)
    return split_vocab


# Functional collectives inside compiled code, where inductor schedules them into the graph. Eager calls use
# the in-place c10d ones on the fresh activation: the plain synchronous path, no work handle to wait on.

def all_reduce(x, group):
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", group)
    dist.all_reduce(x, group=group)  # x is always a fresh activation here
    return x


def gather_last_dim(x, group):
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_single(x, x.dim() - 1, group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, -1)


def apply_tp(model: Transformer, group) -> Transformer:
    """Shard a model whose tensors are still the mapped file's (loading.load_model calls this before it
    converts dtype and device, so each rank copies only its slice) and install the collectives."""
    split_vocab = shard(model, dist.get_rank(group), dist.get_world_size(group))
    reduce = partial(all_reduce, group=group)
    for layer in model.layers:
        layer.reduce = reduce
    if split_vocab:
        model.tok_embeddings.reduce = reduce
        model.gather_logits = partial(gather_last_dim, group=group)
    return model
