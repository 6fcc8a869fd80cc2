"""The CPU backend: few_rows.cpp's kernels serve a model.py model's decode, draft and verify steps, where they
prove to compute what model.py computes.

    apply(model)  # loading.load_model does this on CPU with --backend auto (the default), after the model's
                  # final dtype and device (a later .to() would leave the backend's copies behind)

In order: gate.py (may it serve this model at all: module types, config fields, the math of what its kernels
replace), verdicts.py (was this model, code, CPU and torch checked before), canary.py (model.py in PyTorch against
the served model, bit for bit where they must agree), serving.py (the swap, and the way back). On a mismatch the
model is put back as it was, one line says why, and it runs on model.py's PyTorch path. apply returns the backend's
report (backend.Report), kept with the model: what callers read, never the modules it swapped in.
"""
import sys
import time

import torch

import backend
import ranks
from checkpoint import release_file_pages
from cpu import kernels
from cpu.canary import check_and_serve
from cpu.gate import ATTEND, ONE_CALL, REPLACED, edited, one_call_possible, served, unsupported
from cpu.modules import PRODUCTS
from cpu.one_call import model_py_parts, only_the_mlp
from cpu.serving import serve, served_report
from cpu.verdicts import remember, remembered, verdict_key

__all__ = ["apply"]


def warn(message, runs="the model runs on model.py's PyTorch path"):
    backend.warn("CPU", message, runs)


AROUND = "steps run model.py's forward around its kernels"


def apply(transformer, mapped=None, phases=None) -> backend.Report:
    """Serve a loaded model's CPU steps with few_rows.cpp after checking them against model.py; its report (model.py's
    own where it does not serve, with one warning line where it refused). `mapped`: the model's tensors as mapped
    from its file, whose pages each layer gives back once its weights are copied. The canary's verdict is
    remembered per (weights, code, CPU, torch) (see verdict_key), so only a model's first load pays for it.
    `phases`: a dict that gets the seconds each part took."""
    return backend.attach(transformer, try_to_serve(transformer, {} if phases is None else phases, mapped or {}))


def try_to_serve(transformer, phases, mapped) -> backend.Report:
    if transformer.tok_embeddings.weight.device.type != "cpu":
        return backend.torch_report(transformer)
    if transformer.tok_embeddings.weight.dtype == torch.float16:
        reason = "none of its kernels takes fp16, and PyTorch's fp16 products on a CPU are slow (SmolLM2: 3 tok/s)"
        warn(reason + "; --dtype bf16 (the default) or fp32 are served", "the model runs on model.py's PyTorch path")
        return backend.torch_report(transformer, reason)
    products = [m for m in transformer.modules() if type(m) in PRODUCTS and served(m)]
    if not products:
        return backend.torch_report(transformer)
    reason = unsupported(transformer)
    if reason:
        warn(reason)
        return backend.torch_report(transformer, reason)
    start = time.perf_counter()
    if not kernels.load():
        return backend.torch_report(transformer, "few_rows.cpp did not build")
    phases["kernels"] = time.perf_counter() - start
    step = one_call_possible(transformer, set(products))
    changed = edited({**(ONE_CALL if step else {}), **{name: REPLACED[name] for name in ATTEND}})
    edits = {name for name, _ in changed}
    if changed:
        name, why = changed[0]
        parts = model_py_parts(edits) if step else "attention"
        if step and only_the_mlp(edits):
            steps = "each step one few_rows.cpp call that runs model.py's code for the MLP"
        else:
            steps = "steps run model.py's forward" + (f", its {parts} as model.py's code" if parts else "") \
                + ", the rest in few_rows.cpp's calls"
        warn(f"{name} is not the math its {'kernels implement' if name in ATTEND else 'one-call step implements'}: "
             f"{why}", steps)
    start = time.perf_counter()
    key = verdict_key(transformer)
    known = remembered(key)
    phases["verdict lookup"] = time.perf_counter() - start
    if known is not None:
        if known["reason"]:
            warn(known["reason"] + " (remembered from its check; any edit to the code checks again)")
            return backend.torch_report(transformer, known["reason"])
        start = time.perf_counter()
        release_file_pages(mapped.values())
        one_call = known.get("one_call", True)
        if isinstance(one_call, str):
            warn(f"{one_call} (remembered from its check)", AROUND)
        _, parts = serve(transformer, products, mapped, not isinstance(one_call, str))
        if parts is not None:
            parts.install(edits)
        phases["serve"] = time.perf_counter() - start
        return served_report(transformer, products, model_py_parts(edits))
    say = ranks.is_rank0()  # under torchrun, rank 0 speaks for all
    if say:
        print("CPU backend: checking its kernels against model.py on this model (once per weights, code, CPU and "
              "torch)...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        reason, one_call = check_and_serve(transformer, products, mapped, phases, edits)
    except BaseException:
        if say:
            print(" interrupted", file=sys.stderr)
        raise
    phases["check"] = time.perf_counter() - start - phases.get("serve", 0.0)
    if say:
        print(f" {'refused' if reason else 'serves'} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if isinstance(one_call, str) and not reason:
        warn(one_call, AROUND)
    remember(key, reason, one_call)
    if reason:
        warn(reason)
        return backend.torch_report(transformer, reason)
    return served_report(transformer, products, model_py_parts(edits))
