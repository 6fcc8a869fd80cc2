"""The canary: a decode (2 rows) and a verify (2 x 5 rows) from one cache state, run three ways: by model.py in
PyTorch before the backend serves (with the prompt that makes the state, as one forward: the same math, in one decode
of each quantized weight); by model.py's forward around the backend's products and attention; and by the
backend's step (a Llama-family step is one C++ call that re-implements model.py's forward around them). The last two
must give the same logits and cache entries bit for bit in bf16, where the one-call step rounds as eager PyTorch does
(within ONE_CALL_FP32 in float32, TOLERANCE where products round their inputs): that is where a fork's change to
model.py's math shows. The backend against PyTorch must agree within TOLERANCE: its products and attention sum in
another order than PyTorch's kernels (as any other BLAS would)."""
import time

import torch

from checkpoint import release_file_pages
from cpu.serving import restore, serve

# The backend against PyTorch's kernels: the RMS of the logits' difference over the logits' RMS (what was measured
# beside it: docs/how-it-works.md), or twice the model's own noise floor where that is larger (noise_floor).
TOLERANCE = 0.05
# The canary's tokens: the first ones, whose embedding rows share a few pages (random ones would each map up to a
# 2 MiB folio of the file).
TOKENS = 64
ONE_CALL_FP32 = 1e-5  # the one-call step against model.py's forward, float32: largest |difference| / largest |logit|


def caches(transformer):
    return [t for layer in transformer.layers for t in (layer.attention.kv_cache.k_cache,
                                                        layer.attention.kv_cache.v_cache)]


def steps():
    """The canary's decode (2 rows at positions 12 and 7) and verify (2 x 5 rows after them): (tokens, positions)."""
    g = torch.Generator().manual_seed(0)
    decode = (torch.randint(0, TOKENS, (2, 1), generator=g), torch.tensor([[12], [7]]))
    verifying = (torch.randint(0, TOKENS, (2, 5), generator=g), torch.tensor([[13], [8]]) + torch.arange(5))
    return decode, verifying


def canary(transformer, run, state, verify=True):
    """From the cache `state`: the decode, then the verify (steps()), run by run(tokens, positions); their logits and
    the cache entries they wrote (without `verify`: the decode's logits)."""
    for cache, saved in zip(caches(transformer), state):
        cache.copy_(saved)
    decode, verifying = steps()
    with torch.no_grad():
        if not verify:
            return [run(*decode)]
        logits = [run(*decode), run(*verifying)]
    return logits + [t.clone() for t in caches(transformer)]


def reference(transformer):
    """model.py's prompt and canary as one forward (its quantized forwards decode every weight at each call): row 0
    its 12 prompt tokens, then the decode and verify at 12..17; row 1 its first 7, the decode and verify at 7..12, then
    its last 5 at 13..17, slots its steps never read. -> (the cache state the canary starts from: what each step
    reads of it is the prompt's, the same math as a prompt then the steps; the canary's logits and cache entries)"""
    transformer.setup_caches(2, 32)  # scratch: a request's setup_caches sizes them anew
    prompt = torch.randint(0, TOKENS, (2, 12), generator=torch.Generator().manual_seed(1))
    (decode, at), (verifying, after) = steps()
    tokens = torch.stack([torch.cat([prompt[0], decode[0], verifying[0]]),
                          torch.cat([prompt[1, :7], decode[1], verifying[1], prompt[1, 7:]])])
    with torch.no_grad():  # each token at the position of its index; the steps' logits only
        logits = transformer(tokens, torch.arange(18).expand(2, 18), torch.cat([at, after], 1))
    state = [t.clone() for t in caches(transformer)]
    return state, list(logits.split([1, 5], 1)) + state


def largest(expected, got) -> float:
    """The largest |difference| over the canary's logits and cache entries, over max(1, the largest |logit|)."""
    scale = max(1.0, max(t.float().abs().max().item() for t in expected[:2]))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(expected, got)) / scale


def rms(expected, got) -> float:
    """The RMS of the logits' difference over the logits' RMS, the larger of decode and verify."""
    return max(((a.float() - b.float()).pow(2).mean().sqrt() / a.float().pow(2).mean().sqrt()).item()
               for a, b in zip(expected[:2], got[:2]))


def noise_floor(transformer, state, expected) -> float:
    """How far model.py's own decode logits move (rms) when every layer's output moves by at most one unit in its last
    place, as another order of the same sums moves it: a deep model of random weights, whose logits are nearly flat,
    moves as far as the backend does (the 1.5B's shapes in int4: 0.065, against 0.063); a real one much less (SmolLM2
    int4: 0.023). One forward (the decode's): model.py's quantized forwards decode every weight at each call."""
    g = torch.Generator().manual_seed(2)

    def one_ulp(module, args, out):
        signs = torch.randint(-1, 2, out.shape, generator=g).to(out.dtype)
        return out + out * signs * torch.finfo(out.dtype).eps

    hooks = [layer.register_forward_hook(one_ulp) for layer in transformer.layers]
    try:
        return rms(expected[:1], canary(transformer, transformer, state, verify=False))
    finally:
        for hook in hooks:
            hook.remove()


def check_and_serve(transformer, products, mapped, phases, edits=frozenset()) -> tuple[str | None, bool | str]:
    """The canary: model.py in PyTorch, then served (model.py's forward around the products and attention, and the
    backend's step: the one-call step, or where `edits` names functions of model.py a fork edited, the one-call step
    calling the fork's MLP (an edited FeedForward.forward alone) or a call per module that it left unedited).
    -> (None where the backend serves, else why not, with the model put back on model.py's modules; True where that
    step serves, else why it does not: where it differs from the forward around the same kernels, steps run that
    forward instead). The model's noise floor is measured only where the backend is past
    TOLERANCE (the model put back on model.py's modules for it, then served again)."""
    state, expected = reference(transformer)
    originals, parts, around, step = serve_and_step(transformer, products, mapped, phases, edits, state)
    off = rms(expected, around)
    if off > TOLERANCE:
        restore(transformer, originals, parts)
        tolerance = max(TOLERANCE, 2 * noise_floor(transformer, state, expected))
        if off > tolerance:
            return (f"its products and attention differ from PyTorch's by {off:.3g} RMS of the logits "
                    f"(bound {tolerance:.3g})"), False
        originals, parts, around, step = serve_and_step(transformer, products, mapped, phases, edits, state)
    return None, step


def serve_and_step(transformer, products, mapped, phases, edits, state):
    """Serve the model, run the canary around the kernels and through the backend's step (kept where it gives what
    model.py's forward around the same kernels gives). -> (what restore needs, the canary around the kernels, True
    or why the step does not serve)."""
    release_file_pages(mapped.values())  # serve reads each layer again, and gives its pages back after
    start = time.perf_counter()
    originals, parts = serve(transformer, products, mapped)
    phases["serve"] = phases.get("serve", 0.0) + time.perf_counter() - start
    around = canary(transformer, transformer, state)
    step = parts is not None
    if step:
        parts.install(set(edits))
        stepped = canary(transformer, transformer, state)
        if transformer.tok_embeddings.weight.dtype == torch.bfloat16:
            off, bound = largest(around, stepped), 0.0  # it rounds where eager PyTorch rounds: the same bits
        elif any(m.rounds_inputs() for m in products):
            off, bound = rms(around, stepped), TOLERANCE
        else:
            off, bound = largest(around, stepped), ONE_CALL_FP32
        if off > bound:
            # Where the step's copy of eager PyTorch's roundings misses (RMSNorm's sum did, without PyTorch's cascade),
            # the kernels around model.py still serve.
            parts.remove()
            step = f"its {'one-call step' if not edits else 'step'} differs from model.py's forward by {off:.3g} " \
                   f"(bound {bound:g})"
    return originals, parts, around, step
