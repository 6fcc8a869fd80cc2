"""Serving a model with the backend's modules, and putting it back on model.py's."""
import backend
import model
from checkpoint import release_file_pages
from cpu.gate import ATTEND, REPLACED, edited, one_call_possible
from cpu.kernels import STEP_TOKENS
from cpu.huge_pages import HugePages, give_back_heap, move_to_huge_pages
from cpu.modules import PRODUCTS, Attention, Linear
from cpu.one_call import Stack, StepParts


def serve(transformer, products, mapped, step=True) -> tuple[list, StepParts | None]:
    """Swap in the backend's modules layer by layer (runtime layouts, stacks, huge pages) and give back each layer's
    file pages. -> (what restore needs, the parts of a Llama-family step where `step` and the model allow one, which
    their install puts in)."""
    attend_edited = bool(edited({name: REPLACED[name] for name in ATTEND}))
    originals = [(m, type(m), set(vars(m))) for m in products]  # restore drops the attributes the backend adds
    for m in products:
        m.__class__ = PRODUCTS[type(m)]
    if not attend_edited:  # else attention runs model.py's code, and the products are still served
        for layer in transformer.layers:
            originals.append((layer.attention, model.Attention, set(vars(layer.attention))))
            layer.attention.__class__ = Attention
    stacked = step and one_call_possible(transformer, set(products))
    pages, step_products = HugePages(), []
    parts = [(f"layers.{i}.", layer) for i, layer in enumerate(transformer.layers)] + [("output.", transformer.output)]
    for prefix, part in parts:
        if part is transformer.output:
            mine = [part] if part in products else []
        else:  # in the order a step calls them
            attention, mlp = part.attention, part.feed_forward
            mine = [m for m in (attention.wq, attention.wk, attention.wv, attention.wo, mlp.w1,
                                getattr(mlp, "w3", None), mlp.w2) if m is not None and m in products]
        for m in mine:
            if isinstance(m, Linear):
                m.prepare(shared=[transformer.tok_embeddings.weight])
            else:
                m.prepare()
        if stacked and part is not transformer.output:
            qkv = [part.attention.wq, part.attention.wk, part.attention.wv]
            gate_up = [part.feed_forward.w1, part.feed_forward.w3]
            stacked = Stack.stackable(qkv) and Stack.stackable(gate_up)
            if stacked:  # in the order a step reads them
                mine = [Stack(qkv, pages), move_to_huge_pages([part.attention.wo], pages)[0],
                        Stack(gate_up, pages), move_to_huge_pages([part.feed_forward.w2], pages)[0]]
                step_products += mine
        if not stacked or part is transformer.output:
            move_to_huge_pages(mine, pages)
        names = [n for n in mapped if n.startswith(prefix)]
        if prefix == "output." and transformer.args.tie_embeddings and "tok_embeddings.weight" in mapped:
            names.append("tok_embeddings.weight")
        release_file_pages(mapped[n] for n in names)
        give_back_heap()
    if transformer.args.tie_embeddings and transformer.output in products:  # the head's copy serves the embedding
        transformer.tok_embeddings.weight = transformer.output.weight
    return originals, StepParts(transformer, step_products + [transformer.output]) if stacked else None


def served_report(transformer, products, model_py=None) -> backend.Report:
    """What the backend serves. Its steps are never compiled: a one-call step would only gain Dynamo's entry and
    guards, and Inductor's kernels around few_rows.cpp's products do not give a verify's rows a decode's bits (a
    Qwen2.5-Coder mxfp4 target drafted by its 0.5B parted from plain decoding at token 44; eagerly it does not)."""
    one_call = transformer.__dict__.get("one_call_step") is not None
    operands = {m: m.operands() for m in products}
    if one_call:
        steps = "each step one call" + (f" (calling its {model_py} as model.py's code)" if model_py else "")
    else:
        steps = "steps through model.py's forward" + (f" (its {model_py} as model.py's code)" if model_py else "")
    return backend.Report(
        name="cpu", serves=f"few_rows.cpp: {len(products)} products and attention, {steps}",
        # each output summed by one thread, where no model.py code runs in the step
        one_call_step=one_call, compile_steps=False, sizes_threads=one_call and not model_py,
        step_bytes=backend.step_bytes(transformer, {m: (*ops[:2], m.bias) for m, ops in operands.items()}),
        held_bytes=backend.held_bytes(transformer, [t for ops in operands.values() for t in ops]),
        max_verify_tokens=STEP_TOKENS)  # a step of more tokens a row goes to PyTorch's GEMM, which rounds otherwise


def restore(transformer, originals, parts=None):
    """Put the model back on model.py's modules (the weights stay where the backend copied them)."""
    if parts is not None:
        parts.remove()
    for module, kind, attributes in originals:
        if isinstance(module, Linear):
            module.restore_weight()
        module.__class__ = kind
        for name in set(vars(module)) - attributes:
            del module.__dict__[name]
