"""A Llama-family step in one few_rows.cpp call: the products that read one input stacked (q/k/v, gate/up) and the
step that runs every layer in C++ (OneCallStep)."""
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

    def __init__(self, transformer, products):
        self.model = transformer
        self.products = products  # per layer: q/k/v stacked, wo, gate/up stacked, w2; then the LM head
        self.made_for, self.step_operands = None, None

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
            return torch.ops.few_rows.llama_step(tokens.contiguous(), input_pos.contiguous(), *self.operands())
        return model.Transformer.forward(self.model, tokens, input_pos, logits_idx)
