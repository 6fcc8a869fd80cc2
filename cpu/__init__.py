"""The CPU backend: few_rows.cpp's kernels serve a model.py model's decode, draft and verify steps, where they
prove to compute what model.py computes.

    apply(model)  # loading.load_model does this on CPU with --backend auto (the default), after the model's
                  # final dtype and device (a later .to() would leave the backend's copies behind)

It checks that every module it would replace or run is exactly a type it implements, that the config holds no
field it does not know, and that the functions its kernels replace or its one-call step re-implements have the math
it was written against (REPLACED, ONE_CALL: fingerprints of their syntax trees, blind to comments, layout, the names
of locals and aliases). Then a canary: a decode (2 rows) and a verify (2 x 5 rows) from one cache state, run three
ways: by model.py in PyTorch before the backend serves; by model.py's forward around the backend's products and
attention; and by the backend's step (a Llama-family step is one C++ call that re-implements model.py's forward
around them). The last two must give the same logits and cache entries bit for bit in bf16, where the one-call step
rounds as eager PyTorch does (within ONE_CALL_FP32 in float32, TOLERANCE where products round their inputs): that is
where a fork's change to model.py's math shows. The backend against PyTorch must agree within TOLERANCE: its products
and attention sum in another order than PyTorch's kernels (as any other BLAS would). On a mismatch it puts the model
back as it was, says so in one line, and the model runs on model.py's PyTorch path. The verdict is remembered per
(weights, code, CPU, torch) (verdict_key), so a model pays for its canary once, not at every load. apply returns
the backend's report (backend.Report), kept with the model: what callers read, never the modules it swapped in.
"""
import dataclasses
import hashlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import backend
import model
import quantize
import tp
from checkpoint import release_file_pages
from cpu import kernels
from cpu.fingerprints import fingerprint, source_hash
from cpu.modules import PRODUCTS, Attention, HugePages, OneCallStep, Stack, move_to_huge_pages

# The config fields whose meaning the backend implements: the one-call step reads norm_eps; the rest shape what
# model.py computes around the products and attention (rotary tables, biases, the family's wiring).
KNOWN_FIELDS = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "family", "norm_eps",
                "rope_theta", "tie_embeddings", "max_seq_len", "rope_scaling", "rotary_dim", "qkv_bias"}
# The modules it runs as model.py has them (exact types: a subclass may compute something else).
KEPT = (model.Transformer, model.Block, model.FeedForward, model.RMSNorm, model.KVCache, nn.LayerNorm, nn.Embedding,
        nn.ModuleList, tp.VocabShardEmbedding)
__all__ = ["apply", "MAX_VERIFY_TOKENS"]
RUNTIME = ("scale_factors", "nibbles", "group_factors", "values", "block_factors", "table")
# The backend against PyTorch's kernels: the RMS of the logits' difference over the logits' RMS (what was measured
# beside it: docs/how-it-works.md).
TOLERANCE = 0.05
# The canary's tokens: the first ones, whose embedding rows share a few pages (a random one each mapped up to a
# 2 MiB folio of the file: 37 MB for 24 tokens).
TOKENS = 64
ONE_CALL_FP32 = 1e-5  # the one-call step against model.py's forward, float32: largest |difference| / largest |logit|
MAX_VERIFY_TOKENS = kernels.STEP_TOKENS  # a step of more tokens a row goes to PyTorch's GEMM, which rounds otherwise


# The functions whose math the backend's kernels replace outright, so that no canary comparison of its own sees an
# edit to them: (fingerprint of the math it was written against, hash of the shipped source; cpu/fingerprints.py). A
# fork that edits one gets model.py's path; whoever changes one here updates the kernels, then both hashes
# (tests/test_cpu.py prints them).
REPLACED = {"model.Attention.attend": ("acd364298b21851a", "e7f628b8"),
            "quantize.round_activations": ("23fc0b05f95d32cd", "89c04ddb"),
            "quantize.Int8Linear.forward": ("53aee6a4dac6f874", "6599e64c"),
            "quantize.Int8Linear.dequantize": ("8dfc74cf09a780b6", "c67759bf"),
            "quantize.Int4Linear.forward": ("d90a8014854b3f47", "b3a53210"),
            "quantize.Int4Linear.dequantize": ("f3baa7234fdeb728", "7ff5cb69"),
            "quantize.MXLinear.forward": ("801f44b24116caa7", "37c8039d"),
            "quantize.MXLinear.dequantize": ("ae3abfd669e2d04d", "474422a4")}


# What the one-call step re-implements. The canary compares it with these bit for bit, but only at the positions and
# shapes it runs (a sliding window that starts past them would not show): an edit to one turns the one-call step
# off, and steps run model.py's forward around the backend's products and attention.
ONE_CALL = {"model.Transformer.forward": ("fec92bebabc5086a", "7e537d0f"),
            "model.Block.forward": ("826e320b54bf4f80", "42db41e4"),
            "model.Attention.forward": ("652dc9c1eae8a36d", "db13c5af"),
            "model.FeedForward.forward": ("a0c9f9da8fdab390", "bbae3a33"),
            "model.RMSNorm.forward": ("ae9aea0131f4195a", "e3e8c7ef"),
            "model.apply_rotary": ("c8d0bc7a40e41ba0", "15fa3d16"),
            "model.KVCache.update": ("271a7936a0e7dc48", "d2e9d00b")}


def edited(fingerprints) -> list[tuple[str, str]]:
    """The functions that are not the shipped math the backend implements: (name, what differs). The shipped source
    is the shipped math on any interpreter; any other source is compared as math (its fingerprint)."""
    modules = {"model": model, "quantize": quantize}
    changed = []
    for name, (math, source) in fingerprints.items():
        target = modules[name.split(".")[0]]
        for part in name.split(".")[1:]:
            target = getattr(target, part)
        try:
            if source_hash(target) == source or fingerprint(target) == math:
                continue
            where = f"{Path(inspect.getsourcefile(target)).name}:{target.__code__.co_firstlineno}"
            changed.append((name, f"its syntax tree at {where} differs from the shipped one's in more than comments, "
                                  "layout or the names of locals"))
        except (OSError, TypeError):  # defined at run time: nothing to compare
            changed.append((name, "its source cannot be read"))
    return changed


def warn(message, runs="the model runs on model.py's PyTorch path"):
    backend.warn("CPU", message, runs)


AROUND = "steps run model.py's forward around its kernels"


def unsupported(transformer) -> str | None:
    """Why the backend cannot vouch for this model, or None."""
    extra = [f.name for f in dataclasses.fields(transformer.args) if f.name not in KNOWN_FIELDS]
    if extra:
        return f"config field '{extra[0]}' is not one it implements"
    changed = edited(REPLACED)
    if changed:
        return "{} is not the math its kernels implement: {}".format(*changed[0])
    for name, module in transformer.named_modules():
        if type(module) not in KEPT + tuple(PRODUCTS) + (model.Attention,):
            return f"module {name or 'model'} is a {type(module).__name__}, not a type it implements"
    return None


def served(module) -> bool:
    """Whether few_rows.cpp multiplies by this product's weight: on CPU; bf16 or float32 (not fp16) where it is not
    quantized, with in_features a multiple of 16."""
    weight = module.weight
    if type(module) in (nn.Linear, quantize.Int8Linear):
        return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32, torch.int8)
                and weight.shape[1] % 16 == 0)
    return weight.device.type == "cpu"


def caches(transformer):
    return [t for layer in transformer.layers for t in (layer.attention.kv_cache.k_cache,
                                                        layer.attention.kv_cache.v_cache)]


def canary(transformer, run, state):
    """From the cache `state`: a decode (2 rows at positions 12 and 7), then a verify (2 x 5 rows), run by
    run(tokens, positions); their logits and the cache entries they wrote."""
    for cache, saved in zip(caches(transformer), state):
        cache.copy_(saved)
    g = torch.Generator().manual_seed(0)
    decode = (torch.randint(0, TOKENS, (2, 1), generator=g), torch.tensor([[12], [7]]))
    verify = (torch.randint(0, TOKENS, (2, 5), generator=g), torch.tensor([[13], [8]]) + torch.arange(5))
    with torch.no_grad():
        logits = [run(*decode), run(*verify)]
    return logits + [t.clone() for t in caches(transformer)]


def largest(expected, got) -> float:
    """The largest |difference| over the canary's logits and cache entries, over max(1, the largest |logit|)."""
    scale = max(1.0, max(t.float().abs().max().item() for t in expected[:2]))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(expected, got)) / scale


def rms(expected, got) -> float:
    """The RMS of the logits' difference over the logits' RMS, the larger of decode and verify."""
    return max(((a.float() - b.float()).pow(2).mean().sqrt() / a.float().pow(2).mean().sqrt()).item()
               for a, b in zip(expected[:2], got[:2]))


def rounds_inputs(module) -> bool:
    """Products that round their inputs (int4 to 8 bits, packed MX 6-bit codes to bf16)."""
    return type(module).__name__ == "Int4Linear" or getattr(module, "table", None) is not None


def apply(transformer, mapped=None, phases=None) -> backend.Report:
    """Serve a loaded model's CPU steps with few_rows.cpp after checking them against model.py; its report (model.py's
    own where it does not serve, with one warning line where it refused). `mapped`: the model's tensors as mapped
    from its file, whose pages each layer gives back once its weights are copied. The canary's verdict is
    remembered per (weights, code, CPU, torch) (see verdict_key), so only a model's first load pays for it.
    `phases`: a dict that gets the seconds each part took."""
    return backend.attach(transformer, try_to_serve(transformer, {} if phases is None else phases, mapped or {}))


def try_to_serve(transformer, phases, mapped) -> backend.Report:
    products = [m for m in transformer.modules() if type(m) in PRODUCTS and served(m)]
    if transformer.tok_embeddings.weight.device.type != "cpu" or not products:
        return backend.torch_report(transformer)  # an fp16 model, say: nothing here multiplies fp16 weights
    reason = unsupported(transformer)
    if reason:
        warn(reason)
        return backend.torch_report(transformer, reason)
    start = time.perf_counter()
    if not kernels.load():
        return backend.torch_report(transformer, "few_rows.cpp did not build")
    phases["kernels"] = time.perf_counter() - start
    changed = edited(ONE_CALL) if one_call_possible(transformer, set(products)) else []
    if changed:
        warn("{} is not the math its one-call step implements: {}".format(*changed[0]), AROUND)
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
        serve(transformer, products, mapped, not isinstance(one_call, str))
        phases["serve"] = time.perf_counter() - start
        return served_report(transformer, products)
    say = tp.is_rank0()  # under torchrun, rank 0 speaks for all
    if say:
        print("CPU backend: checking its kernels against model.py on this model (once per weights, code, CPU and "
              "torch)...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        reason, one_call = check_and_serve(transformer, products, mapped, phases)
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
    return served_report(transformer, products)


def served_report(transformer, products) -> backend.Report:
    """What the backend serves. Its steps are never compiled: a one-call step would only gain Dynamo's entry and
    guards, and Inductor's kernels around few_rows.cpp's products do not give a verify's rows a decode's bits (a
    Qwen2.5-Coder mxfp4 target drafted by its 0.5B parted from plain decoding at token 44; eagerly it does not)."""
    one_call = isinstance(transformer.__dict__.get("forward"), OneCallStep)
    operands = {m: m.operands() for m in products}
    return backend.Report(
        name="cpu", serves=f"few_rows.cpp: {len(products)} products and attention"
        + (", each step one call" if one_call else ", steps through model.py's forward"),
        one_call_step=one_call, compile_steps=False, sizes_threads=one_call,  # each output summed by one thread
        step_bytes=backend.step_bytes(transformer, {m: (*ops[:2], m.bias) for m, ops in operands.items()}),
        held_bytes=backend.held_bytes(transformer, [t for ops in operands.values() for t in ops]),
        max_verify_tokens=MAX_VERIFY_TOKENS)


def check_and_serve(transformer, products, mapped, phases) -> tuple[str | None, bool | str]:
    """The canary: model.py in PyTorch, then served (model.py's forward around the products and attention, and the
    one-call step). -> (None where the backend serves, else why not, with the model put back on model.py's modules;
    True where the one-call step serves, else why it does not: where it differs from the forward around the same
    kernels, steps run that forward instead)."""
    transformer.setup_caches(2, 32)  # scratch: a request's setup_caches sizes them anew
    with torch.no_grad():
        prompt = torch.randint(0, TOKENS, (2, 12), generator=torch.Generator().manual_seed(1))
        transformer(prompt, torch.arange(12).expand(2, 12), torch.tensor([[11], [11]]))
    state = [t.clone() for t in caches(transformer)]
    expected = canary(transformer, transformer, state)
    release_file_pages(mapped.values())  # serve reads each layer again, and gives its pages back after
    start = time.perf_counter()
    originals = serve(transformer, products, mapped)
    phases["serve"] = time.perf_counter() - start
    around = canary(transformer, lambda *a: model.Transformer.forward(transformer, *a), state)
    one_call = isinstance(transformer.forward, OneCallStep)
    if one_call:
        one_call_logits = canary(transformer, transformer, state)
        if transformer.tok_embeddings.weight.dtype == torch.bfloat16:
            off, bound = largest(around, one_call_logits), 0.0  # it rounds where eager PyTorch rounds: the same bits
        elif any(rounds_inputs(m) for m in products):
            off, bound = rms(around, one_call_logits), TOLERANCE
        else:
            off, bound = largest(around, one_call_logits), ONE_CALL_FP32
        if off > bound:
            # Where the step's copy of eager PyTorch's roundings misses (RMSNorm's sum did, without PyTorch's cascade:
            # the Qwen pair's mxfp4 and mxfp6 files, 0.005-0.018), the kernels around model.py still serve.
            del transformer.forward
            one_call = f"its one-call step differs from model.py's forward by {off:.3g} (bound {bound:g})"
    off = rms(expected, around)
    if off > TOLERANCE:
        restore(transformer, originals)
        return f"its products and attention differ from PyTorch's by {off:.3g} RMS of the logits (bound {TOLERANCE})", \
            False
    return None, one_call


# ---------------------------------------------------------------- the remembered verdict

# The modules whose code the verdict depends on: model.py's math, the quantized forms, the backend itself.
CODE_MODULES = ("model", "quantize", "mx", "tp", "cpu", "cpu.modules", "cpu.kernels")


def verdict_key(transformer) -> str:
    """What the canary's verdict depends on, hashed: the code as it runs (the bytecode of every function and method
    of CODE_MODULES and of the model's module types, and their module-level settings, so a fork's edit or a
    monkeypatch checks again), the
    kernels' build (source, flags, torch, CPU), the config, every tensor's name, shape and dtype and a sample of
    its bytes (its first, middle and last 4 KiB: a re-quantized or re-converted file checks again), the
    backend's bounds and fingerprints."""
    digest = hashlib.sha256()
    functions = []
    for name in CODE_MODULES:
        for value in vars(sys.modules[name]).values():
            if inspect.isfunction(value) and value.__module__ == name:
                functions.append(value)
            elif inspect.isclass(value) and value.__module__ == name:
                functions += [f for f in vars(value).values() if inspect.isfunction(f)]
    for kind in sorted({type(m) for m in transformer.modules()}, key=lambda k: f"{k.__module__}.{k.__qualname__}"):
        for klass in kind.__mro__:
            if klass.__module__.split(".")[0] != "torch":
                functions += [f for f in vars(klass).values() if inspect.isfunction(f)]
    for function in functions:
        digest.update(code_bytes(function.__code__))
    for name in CODE_MODULES:  # module-level settings the code reads (mx.FORMATS, quantize.ROWS, ...)
        for key, value in sorted(vars(sys.modules[name]).items()):
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, tuple, dict)):
                digest.update(f"{name}.{key}={value!r}".encode())
    build = kernels.built or kernels.build_name(kernels.source_text(), "native")
    digest.update(repr((build, torch.__version__, sys.version, dataclasses.asdict(transformer.args), REPLACED, ONE_CALL,
                        TOLERANCE, ONE_CALL_FP32, TOKENS)).encode())
    seen = set()
    for name, t in list(transformer.named_parameters()) + list(transformer.named_buffers()):
        digest.update(f"{name} {list(t.shape)} {t.dtype}".encode())
        if t.data_ptr() in seen or t.numel() == 0 or name.endswith(("k_cache", "v_cache")):
            continue
        seen.add(t.data_ptr())
        flat = t.detach().reshape(-1)
        n = max(1, 4096 // t.element_size())
        for at in (0, max(0, flat.numel() // 2 - n // 2), max(0, flat.numel() - n)):
            digest.update(flat[at:at + n].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def code_bytes(code) -> bytes:
    """A function's code as it computes: instructions, names and constants (nested functions included), without
    line numbers, so moving or commenting code keeps its verdict."""
    parts = [code.co_code, repr(code.co_names).encode()]
    for const in code.co_consts:
        if inspect.iscode(const):
            parts.append(code_bytes(const))
        else:  # a frozenset's order follows the process's string hashing
            parts.append(repr(sorted(map(repr, const)) if isinstance(const, frozenset) else const).encode())
    return b"\0".join(parts)


def verdict_dir() -> Path:
    """FASTDECODE_CACHE, else $XDG_CACHE_HOME/fastdecode, else ~/.cache/fastdecode; verdicts/ in it."""
    root = os.environ.get("FASTDECODE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "fastdecode"
    return Path(root) / "verdicts"


def remembered(key) -> dict | None:
    try:
        verdict = json.loads((verdict_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and "reason" in verdict else None


def remember(key, reason, one_call: bool | str = True):
    """Keep a verdict (written aside and renamed; a cache that cannot be written only costs the next check)."""
    try:
        directory = verdict_dir()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"reason": reason, "one_call": one_call, "torch": torch.__version__}) + "\n")
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        pass


def serve(transformer, products, mapped, one_call=True) -> list:
    """Swap in the backend's modules layer by layer (runtime layouts, stacks, huge pages), give back each layer's
    file pages, and return what restore needs."""
    originals = [(m, type(m)) for m in products]
    for m in products:
        m.__class__ = PRODUCTS[type(m)]
    for layer in transformer.layers:
        originals.append((layer.attention, model.Attention))
        layer.attention.__class__ = Attention
    one_call = one_call and one_call_possible(transformer, set(products)) and not edited(ONE_CALL)
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
            m.prepare()
        if one_call and part is not transformer.output:
            qkv = [part.attention.wq, part.attention.wk, part.attention.wv]
            gate_up = [part.feed_forward.w1, part.feed_forward.w3]
            one_call = Stack.stackable(qkv) and Stack.stackable(gate_up)
            if one_call:  # in the order a step reads them
                mine = [Stack(qkv, pages), move_to_huge_pages([part.attention.wo], pages)[0],
                        Stack(gate_up, pages), move_to_huge_pages([part.feed_forward.w2], pages)[0]]
                step_products += mine
        if not one_call or part is transformer.output:
            move_to_huge_pages(mine, pages)
        names = [n for n in mapped if n.startswith(prefix)]
        if prefix == "output." and transformer.args.tie_embeddings and "tok_embeddings.weight" in mapped:
            names.append("tok_embeddings.weight")
        release_file_pages(mapped[n] for n in names)
    if transformer.args.tie_embeddings and transformer.output in products:  # the head's copy serves the embedding
        transformer.tok_embeddings.weight = transformer.output.weight
    if one_call:
        transformer.forward = OneCallStep(transformer, step_products + [transformer.output])
    return originals


def one_call_possible(transformer, products) -> bool:
    """Whether a step can be one llama_step call: a Llama-family model in bf16 or float32, in one process, every
    product served, no bias but on q/k/v (q/k/v and gate/up must also stack: checked as the layers are served)."""
    args, dtype = transformer.args, transformer.tok_embeddings.weight.dtype
    layers = transformer.layers
    if (args.family != "llama" or dtype not in (torch.bfloat16, torch.float32) or args.dim % 16 or args.head_dim % 16
            or transformer.gather_logits is not model.no_communication or type(transformer.tok_embeddings) is not
            nn.Embedding or any(layer.reduce is not model.no_communication for layer in layers)):
        return False
    unbiased = [p for layer in layers for p in (layer.attention.wo, layer.feed_forward.w1, layer.feed_forward.w3,
                                                layer.feed_forward.w2)] + [transformer.output]
    every = unbiased + [p for layer in layers for p in (layer.attention.wq, layer.attention.wk, layer.attention.wv)]
    norms = [n.weight for layer in layers for n in (layer.attention_norm, layer.ffn_norm)] + [transformer.norm.weight]
    return (all(p in products for p in every) and all(p.bias is None for p in unbiased)
            and all(n.dtype == dtype for n in norms))


def restore(transformer, originals):
    """Put the model back on model.py's modules (the weights stay where the backend copied them)."""
    for module, kind in originals:
        module.__class__ = kind
        for name in RUNTIME:
            module.__dict__.pop(name, None)
    transformer.__dict__.pop("forward", None)
