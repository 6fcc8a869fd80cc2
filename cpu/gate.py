"""Whether the CPU backend may serve a model at all, before any canary: every module it would replace or run is exactly
a type it implements, the config holds no field it does not know, and the functions its kernels replace or its
one-call step re-implements have the math it was written against (REPLACED, ONE_CALL: fingerprints of their syntax
trees, blind to comments, layout, the names of locals and aliases)."""
import dataclasses
import inspect
from pathlib import Path

import torch
import torch.nn as nn

import model
import quantize
import tp
from cpu.fingerprints import fingerprint, source_hash
from cpu.modules import PRODUCTS

# The config fields whose meaning the backend implements: the one-call step reads norm_eps; the rest shape what
# model.py computes around the products and attention (rotary tables, biases, the family's wiring).
KNOWN_FIELDS = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "family", "norm_eps",
                "rope_theta", "tie_embeddings", "max_seq_len", "rope_scaling", "rotary_dim", "qkv_bias"}
# The modules it runs as model.py has them (exact types: a subclass may compute something else).
KEPT = (model.Transformer, model.Block, model.FeedForward, model.RMSNorm, model.KVCache, nn.LayerNorm, nn.Embedding,
        nn.ModuleList, tp.VocabShardEmbedding)


# The functions whose math the backend's kernels replace outright, so that no canary comparison of its own sees an
# edit to them: (fingerprint of the math it was written against, hash of the shipped source; cpu/fingerprints.py),
# a format's forward and dequantize declared by its class in cpu/modules.py. A fork that edits one gets model.py's
# path (but attend: ATTEND); whoever changes one updates the kernels, then both hashes (tests/test_cpu.py prints them).
REPLACED = {"model.Attention.attend": ("acd364298b21851a", "e7f628b8"),
            "quantize.round_activations": ("557dabcc3b770002", "2a62d06d"),
            **{f"quantize.{fmt.__name__}.{name}": math for fmt, product in PRODUCTS.items()
               for name, math in product.replaces.items()}}

# Where a fork edits attention's own math, only attention leaves the kernels: it runs model.py's code (the products
# are still served).
ATTEND = ("model.Attention.attend",)


# What the one-call step re-implements. The canary compares it with these bit for bit, but only at the positions and
# shapes it runs (a sliding window that starts past them would not show): an edit to one turns the one-call step
# off, and steps run model.py's forward, the edited function as model.py's code and the modules whose functions are
# unedited each in one few_rows.cpp call (cpu/one_call.py's BLOCKS).
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


def unsupported(transformer) -> str | None:
    """Why the backend cannot vouch for this model, or None."""
    extra = [f.name for f in dataclasses.fields(transformer.args) if f.name not in KNOWN_FIELDS]
    if extra:
        return f"config field '{extra[0]}' is not one it implements"
    changed = edited({name: math for name, math in REPLACED.items() if name not in ATTEND})
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
    if type(module) is nn.Linear:
        return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
                and weight.shape[1] % 16 == 0)
    return weight.device.type == "cpu"


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
