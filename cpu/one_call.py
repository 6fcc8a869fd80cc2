"""A Llama-family step in one few_rows.cpp call: the products that read one input stacked (q/k/v, gate/up) and the
step that runs every layer in C++ (OneCallStep); where a fork edited only the MLP's math, the same step calling the
fork's MLP for each layer (ModelPyMlp); where it edited other parts, a call per module for the modules whose math it
left as it was (AttentionBlock, FeedForwardBlock, RMSNormRows), model.py's code for the rest (StepParts.install
chooses)."""
import ctypes
import dis
import sys

import torch

import model
from cpu.kernels import STEP_TOKENS, outputs


class Stack:
    """Products that read the same input (q/k/v, gate/up) as one few_rows.cpp call over their operands stacked by
    output rows (as the one-call step takes them): SmolLM2's 211 products a step become 121. The products keep their
    operands, now views into the stacked copy, and every output is the same sum as in its own product."""

    def __init__(self, products, pages=None):
        """pages: a HugePages to stack the operands into (one copy of them, not a stacked copy copied again)."""
        self.products = products
        operands = [p.operands() for p in products]
        empty = pages.empty if pages else torch.empty

        def stacked(tensors):
            out = empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype)
            with torch.no_grad():  # weights that are parameters: cat(out=...) refuses them under autograd
                return torch.cat(tensors, out=out)
        self.weight = stacked([w for w, _, _ in operands])
        self.factors = None if operands[0][1] is None else stacked([f for _, f, _ in operands])
        self.table = operands[0][2]
        self.bias = None if products[0].bias is None else torch.cat([p.bias.float() for p in products])
        self.sizes = [w.shape[0] for w, _, _ in operands]
        self.use_operands(self.weight, self.factors)

    def operands(self):
        return self.weight, self.factors, self.table

    def use_operands(self, weight, factors):
        """Take weight and factors stacked as the products are, and point each product at its rows of them."""
        self.weight, self.factors = weight, factors
        start = 0
        for p, size in zip(self.products, self.sizes):
            p.use_operands(weight[start:start + size], None if factors is None else factors[start:start + size])
            start += size

    @staticmethod
    def stackable(products) -> bool:
        operands = [p.operands() for p in products]
        if len({type(p) for p in products}) > 1 or len({id(t) for _, _, t in operands}) > 1:
            return False
        (w0, f0, _), b0 = operands[0], products[0].bias is None
        return all(w.dtype == w0.dtype and w.shape[1:] == w0.shape[1:] and (f is None) == (f0 is None) and
                   (f is None or f.shape[1:] == f0.shape[1:]) and (p.bias is None) == b0 and
                   outputs(w) == p.weight.shape[0]  # column tiles without padding
                   for (w, f, _), p in zip(operands, products))


class OneCallStep:
    """A Llama-family model's forward where a step (decode, draft catch-up or verify: no logits_idx, at most
    STEP_TOKENS tokens a row) is one call of few_rows.cpp's llama_step: embedding rows, per layer RMSNorm, the
    stacked q/k/v product, rotary, the cache writes, attention, the output product, the residual, RMSNorm, gate/up,
    SiLU times up, down and the residual, then the final norm and the LM head; each result rounded to the model's
    dtype where model.py's eager PyTorch rounds it, so a bf16 step gives its logits bit for bit (the backend checks
    that on every model before it serves). Other calls (prompts) take model.py's forward. It replaces ~150 small
    kernels, their Python calls and Dynamo's guards (docs/how-it-works.md has what that saved)."""

    def __init__(self, transformer, products, mlp=None):
        self.model = transformer
        self.products = products  # per layer: q/k/v stacked, wo, gate/up stacked, w2; then the LM head
        self.made_for, self.step_operands = None, None
        self.mlp = mlp  # a ModelPyMlp where a fork edited model.FeedForward.forward

    def operands(self):
        """What llama_step takes besides tokens and positions, taken anew when setup_caches has reallocated the
        caches (and with them the rotary tables: one identity check, where gathering them took 35 us a step)."""
        m = self.model
        if m.rope_cos is not self.made_for:
            caches = [layer.attention.kv_cache for layer in m.layers]
            norms = [n.weight for layer in m.layers for n in (layer.attention_norm, layer.ffn_norm)] + [m.norm.weight]
            operands = [p.operands() for p in self.products]
            self.step_operands = (
                m.tok_embeddings.weight, m.rope_cos, m.rope_sin, norms, [w for w, _, _ in operands],
                [f for _, f, _ in operands], [t for _, _, t in operands],
                [p.bias if isinstance(p, Stack) else None for p in self.products],  # float32 there (Qwen2's q/k/v)
                [c.k_cache for c in caches], [c.v_cache for c in caches], m.layers[0].attention.n_heads,
                m.layers[0].attention.n_kv_heads, m.args.norm_eps)
            self.made_for = m.rope_cos
        return self.step_operands

    def __call__(self, tokens, input_pos, logits_idx=None):
        if logits_idx is None and tokens.shape[-1] <= STEP_TOKENS:
            if self.mlp is not None:
                return self.mlp.step(tokens.contiguous(), input_pos.contiguous(), self.operands())
            return torch.ops.few_rows.llama_step(tokens.contiguous(), input_pos.contiguous(), *self.operands(), 0,
                                                 None, None, None, None)
        return model.Transformer.forward(self.model, tokens, input_pos, logits_idx)


class ModelPyMlp:
    """A fork's model.FeedForward.forward inside the one-call step: llama_step calls back into Python for each layer's
    MLP (a ctypes function: its normed rows in, the module's output out), so the rest of the step stays one C++ call
    (a call per module from Python cost an edited activation a third of the decode's speed). The step hands over the
    stacked gate/up product of those rows too: the fork's w1(x) and w3(x) of them return its halves (LookedUp); and
    where the fork's forward returns its w2(h) as it is, the step computes that product (Deferred)."""

    def __init__(self, transformer, swapped):
        self.feed_forwards = [layer.feed_forward for layer in transformer.layers]
        self.function = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)(self.run)  # kept: C++ holds its address
        self.address = ctypes.cast(self.function, ctypes.c_void_p).value
        self.rows = self.gates = self.ups = self.out = self.hidden = self.error = self.given = self.down = None
        self.stand_in = torch.empty(0)  # what a Deferred w2 returns: never seen by the fork's code
        for mlp in self.feed_forwards:
            for half, product in enumerate((mlp.w1, mlp.w3)):
                swapped.append((product, type(product)))
                product.__class__, product.looked_up = derived(LookedUp, type(product)), (self, half)
            if mlp.w2.bias is None:  # the step's w2 has none
                swapped.append((mlp.w2, type(mlp.w2)))
                mlp.w2.__class__, mlp.w2.deferred_by = derived(Deferred, type(mlp.w2)), self
            swapped.append((mlp, type(mlp)))
            vars(mlp).update(mlp._modules)  # self.w1 found at once, not by nn.Module.__getattr__ (cold: ~2 us each)

    def run(self, layer):
        try:
            rows, gate, feed_forward = self.rows[layer], self.gates[layer], self.feed_forwards[layer]
            self.given = rows, rows._version, gate._version, gate, self.ups[layer]  # the halves share a version
            if hooked(feed_forward) or getattr(feed_forward, "_compiled_call_impl", None) is not None:
                self.down, out = None, feed_forward(rows)  # a hook would see Deferred's stand-in
            else:  # nn.Module's call is then its forward
                self.down = feed_forward.w2
                out = feed_forward.forward(rows)
            if out is self.stand_in:
                return 2
            if not isinstance(out, torch.Tensor) or out.shape != rows.shape or out.dtype != rows.dtype:
                raise ValueError(f"model.FeedForward.forward returned {describe(out)} for rows {describe(rows)}; the "
                                 "one-call step takes an MLP's output in its input's shape and dtype, as model.py's "
                                 "Block adds it to the residual")
            self.out.copy_(out)
            return 0
        except BaseException as error:  # raised again by step: an exception cannot cross the C++ frames
            self.error = error
            return 1
        finally:
            self.given = self.down = None

    def step(self, tokens, positions, operands):
        embeddings, weights, layers = operands[0], operands[4], len(self.feed_forwards)
        rows = embeddings.new_empty(layers, *tokens.shape, embeddings.shape[1])
        gate_up = embeddings.new_empty(layers, *tokens.shape, outputs(weights[2]))
        self.rows = rows.unbind()  # views made once a step, not once a layer
        self.gates, self.ups = (half.unbind() for half in gate_up.chunk(2, -1))
        self.out = embeddings.new_empty(*tokens.shape, embeddings.shape[1])
        self.hidden = embeddings.new_empty(*tokens.shape, outputs(weights[2]) // 2)
        try:
            return torch.ops.few_rows.llama_step(tokens, positions, *operands, self.address, rows, gate_up, self.out,
                                                  self.hidden)
        except RuntimeError:
            if self.error is None:
                raise
            error, self.error = self.error, None
            raise error from None
        finally:
            self.rows = self.gates = self.ups = self.out = self.hidden = None


def describe(value) -> str:
    return f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__


class LookedUp:
    """A served w1 or w3 inside ModelPyMlp's call: of the rows the step handed the MLP (as it handed them, and while
    neither half was changed in place), its output is the half of the step's stacked product (the same sums); of
    anything else, its own product."""

    def forward(self, x):
        mlp, half = self.looked_up
        given = mlp.given
        if given is not None and x is given[0] and x._version == given[1] and given[3]._version == given[2]:
            return given[3 + half]
        return super().forward(x)


class Deferred:
    """A served w2 inside ModelPyMlp's call: where the call that reached it is one whose result the fork's forward
    returns at once to ModelPyMlp.run (a call instruction followed by a return, in the frame run called:
    returned_to_run), nothing else can see its product, so it copies its input to the step's hidden rows and returns
    ModelPyMlp's stand-in, and the step computes the product from the same operands (the same sums). Elsewhere, or
    where a hook would see its output, its own product."""

    def forward(self, x):
        mlp = self.deferred_by
        if mlp.down is self and x.dtype == mlp.hidden.dtype and x.shape == mlp.hidden.shape and not hooked(self) \
                and returned_to_run(sys._getframe(1)):
            mlp.hidden.copy_(x)
            return mlp.stand_in
        return super().forward(x)


MODULE_CALLS = torch.nn.Module._call_impl.__code__.co_filename  # the frames of nn.Module's call


def returned_to_run(frame) -> bool:
    """Whether the call under way in the first frame above `frame` that is not nn.Module's call machinery returns its
    result at once, and that frame was called by ModelPyMlp.run (directly or through nn.Module's call)."""
    while frame.f_code.co_filename == MODULE_CALLS:
        frame = frame.f_back
    returned = returned_calls.get((frame.f_code, frame.f_lasti))
    if not (returns_at_once(frame.f_code, frame.f_lasti) if returned is None else returned):
        return False
    caller = frame.f_back
    while caller.f_code.co_filename == MODULE_CALLS:
        caller = caller.f_back
    return caller.f_code is ModelPyMlp.run.__code__


returned_calls = {}  # (code, offset) -> whether the instruction there is a call whose result code returns at once


def returns_at_once(code, offset) -> bool:
    """Whether code's instruction at offset is a call followed by a return (its result returned as it is)."""
    instructions = list(dis.get_instructions(code))
    for i, following in zip(instructions, instructions[1:]):
        returned_calls[code, i.offset] = i.opname.startswith("CALL") and following.opname == "RETURN_VALUE"
    return returned_calls.setdefault((code, offset), False)


# nn.Module's global hooks (None where a torch names them otherwise: then every module counts as hooked)
GLOBAL_HOOKS = [getattr(torch.nn.modules.module, f"_global_{kind}", None)
                for kind in ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")]


def hooked(module) -> bool:
    """Whether calling the module runs hooks, its own or global ones (nn.Module's call then does more than forward)."""
    return None in GLOBAL_HOOKS or any(GLOBAL_HOOKS) or bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)


derived_kinds = {}


def derived(mixin, kind):
    """mixin (LookedUp or Deferred) over a product's class, one class per pair."""
    if (mixin, kind) not in derived_kinds:
        derived_kinds[mixin, kind] = type(f"{mixin.__name__}{kind.__name__}", (mixin, kind), {})
    return derived_kinds[mixin, kind]


class Transformer(model.Transformer):
    """model.Transformer whose steps are one llama_step call (its one_call_step, an OneCallStep), where it has one."""

    def forward(self, tokens, input_pos, logits_idx=None):
        if self.one_call_step is not None:
            return self.one_call_step(tokens, input_pos, logits_idx)
        return super().forward(tokens, input_pos, logits_idx)


class AttentionBlock(model.Attention):
    """model.Attention.forward for a step's rows in one few_rows.cpp call (attention_block: the stacked q/k/v product,
    rotary, the cache writes, attention, the output product), bit for bit what the one-call step computes there.
    `block_operands`: the products' operands as the one-call step takes them. A prompt's rows take model.py's."""

    def forward(self, x, cos, sin, mask, input_pos):
        if input_pos.shape[-1] <= STEP_TOKENS:
            return attention_block(self, x, cos, sin, input_pos)
        return super().forward(x, cos, sin, mask, input_pos)


def attention_block(attention, x, cos, sin, input_pos, norm=None):
    """few_rows.cpp's attention_block for a served attention module (an AttentionBlock's operands): its forward, or
    with `norm` (an RMSNorm), x + its forward of norm(x)."""
    return torch.ops.few_rows.attention_block(
        x, input_pos.contiguous(), cos.contiguous(), sin.contiguous(), *attention.block_operands,
        attention.kv_cache.k_cache, attention.kv_cache.v_cache, attention.n_heads, attention.n_kv_heads,
        None if norm is None else norm.weight, 0.0 if norm is None else norm.eps)


class AttendAround(model.Attention):
    """model.Attention.forward for a step's rows where a fork edited only attend: q/k/v, rotary and the cache writes in
    one few_rows.cpp call (attention_queries), model.py's attend, then the output product in another
    (attention_output). `block_operands` as AttentionBlock's."""

    def forward(self, x, cos, sin, mask, input_pos):
        if input_pos.shape[-1] <= STEP_TOKENS:
            return attend_around(self, x, cos, sin, mask, input_pos)
        return super().forward(x, cos, sin, mask, input_pos)


def attend_around(attention, x, cos, sin, mask, input_pos, norm=None):
    """An AttendAround's forward, or with `norm`, x + its forward of norm(x)."""
    qkv, wo = attention.block_operands[:4], attention.block_operands[4:]
    cache = attention.kv_cache
    q = torch.ops.few_rows.attention_queries(
        x, input_pos.contiguous(), cos.contiguous(), sin.contiguous(), *qkv, cache.k_cache, cache.v_cache,
        attention.n_heads, attention.n_kv_heads, None if norm is None else norm.weight,
        0.0 if norm is None else norm.eps)
    y = attention.attend(q, cache.k_cache, cache.v_cache, mask, input_pos)
    return torch.ops.few_rows.attention_output(x, y, *wo, attention.n_heads, norm is not None)


class FeedForwardBlock(model.FeedForward):
    """model.FeedForward.forward (gated) for a step's rows in one few_rows.cpp call (mlp_block: the stacked gate/up
    product, SiLU times up, the down product)."""

    def forward(self, x):
        if x.shape[-2] <= STEP_TOKENS:
            return torch.ops.few_rows.mlp_block(x, *self.block_operands, None, 0.0)
        return super().forward(x)


class RMSNormRows(model.RMSNorm):
    """model.RMSNorm.forward for a step's rows in one few_rows.cpp call, rounded as eager PyTorch rounds it."""

    def forward(self, x):
        if x.shape[-2] <= STEP_TOKENS and x.dtype == self.weight.dtype:
            return torch.ops.few_rows.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return super().forward(x)


class Halves(model.Block):
    """model.Block.forward for a step's rows, each residual branch (x + attention(norm(x)), x + MLP(norm(x))) one
    few_rows.cpp call where its attention (an AttentionBlock) or MLP (a FeedForwardBlock) is served, else model.py's
    code: a fork that edits one of them keeps one call per layer for the rest."""

    def forward(self, x, cos, sin, mask, input_pos):
        if input_pos.shape[-1] > STEP_TOKENS:
            return super().forward(x, cos, sin, mask, input_pos)
        if isinstance(self.attention, AttentionBlock):
            x = attention_block(self.attention, x, cos, sin, input_pos, self.attention_norm)
        elif isinstance(self.attention, AttendAround):
            x = attend_around(self.attention, x, cos, sin, mask, input_pos, self.attention_norm)
        else:
            x = x + self.reduce(self.attention(self.attention_norm(x), cos, sin, mask, input_pos))
        if isinstance(self.feed_forward, FeedForwardBlock):
            return torch.ops.few_rows.mlp_block(x, *self.feed_forward.block_operands, self.ffn_norm.weight,
                                                self.ffn_norm.eps)
        return x + self.reduce(self.feed_forward(self.ffn_norm(x)))


# The functions of model.py that each of them re-implements (the one-call step: every one of them).
BLOCKS = {AttentionBlock: ("model.Transformer.forward", "model.Attention.forward", "model.Attention.attend",
                           "model.apply_rotary", "model.KVCache.update"),
          AttendAround: ("model.Transformer.forward", "model.Attention.forward", "model.apply_rotary",
                         "model.KVCache.update"),
          FeedForwardBlock: ("model.FeedForward.forward",),
          RMSNormRows: ("model.RMSNorm.forward",),
          Halves: ("model.Block.forward", "model.RMSNorm.forward")}


def model_py_parts(edited: set) -> str:
    """Which modules of a step run model.py's code where these functions are edited, in words ("" for none)."""
    attention = "attention" if edited & set(BLOCKS[AttendAround]) else "attend"
    return ", ".join(name for name, kind in ((attention, AttentionBlock), ("MLP", FeedForwardBlock),
                                             ("norms", RMSNormRows), ("layers", Halves)) if edited & set(BLOCKS[kind]))


def only_the_mlp(edited: set) -> bool:
    """Whether the one-call step serves these edits, calling model.py's code for the MLP (ModelPyMlp)."""
    return edited == set(BLOCKS[FeedForwardBlock])


# What they add to a module (restore drops it).
BLOCK_ATTRIBUTES = ("block_operands", "one_call_step", "looked_up", "deferred_by")


class StepParts:
    """What serving made for a Llama-family step: per layer the stacked q/k/v, wo, the stacked gate/up and w2, then the
    LM head. install puts in the fastest step model.py's math allows; remove takes it out again."""

    def __init__(self, transformer, products):
        self.model, self.products, self.swapped = transformer, products, []

    def install(self, edited: set) -> str | None:
        """The one-call step where none of model.py's functions it re-implements is edited (and the head's tiles are
        not padded); else a call per module whose functions are not edited (`edited`: their names). -> None for the
        one-call step, else which modules run model.py's code, in words."""
        m, head = self.model, self.products[-1]
        self.swapped.append((m, type(m)))
        m.__class__ = Transformer
        unpadded = outputs(head.operands()[0]) == head.weight.shape[0]
        whole = not edited and unpadded
        mlp_only = only_the_mlp(edited) and unpadded
        m.one_call_step = OneCallStep(m, self.products, ModelPyMlp(m, self.swapped) if mlp_only else None) \
            if whole or mlp_only else None
        if whole:
            return None
        if mlp_only:
            return model_py_parts(edited)
        kept = {kind for kind, functions in BLOCKS.items() if not edited & set(functions)}
        for i, layer in enumerate(m.layers):
            qkv, wo, gate_up, down = self.products[4 * i:4 * i + 4]
            attention = AttentionBlock if AttentionBlock in kept else AttendAround
            modules = ((layer.attention, attention, (*qkv.operands(), qkv.bias, *wo.operands())),
                       (layer.feed_forward, FeedForwardBlock, (*gate_up.operands(), *down.operands())),
                       (layer.attention_norm, RMSNormRows, ()), (layer.ffn_norm, RMSNormRows, ()), (layer, Halves, ()))
            for module, kind, operands in modules:
                if kind in kept:
                    self.swapped.append((module, type(module)))
                    module.__class__, module.block_operands = kind, operands
        if RMSNormRows in kept:
            self.swapped.append((m.norm, type(m.norm)))
            m.norm.__class__ = RMSNormRows
        return model_py_parts(edited)

    def remove(self):
        """Back to model.py's forward around the products and attention."""
        for module, kind in reversed(self.swapped):
            module.__class__ = kind
            for name in BLOCK_ATTRIBUTES:
                module.__dict__.pop(name, None)
            for name, submodule in module._modules.items():  # ModelPyMlp's copies in the instance's dict
                if module.__dict__.get(name) is submodule:
                    del module.__dict__[name]
        self.swapped = []
