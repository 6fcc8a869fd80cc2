"""Loading a converted checkpoint: config.json, the mapped safetensors file (plain or quantize.py's), tensor
parallelism, dtype and device, then the backend of that device (cpu/ or gpu.py), whose report says what it serves
(backend.report). What generate.py, the scripts and the tests load models with.
"""
import argparse
import dataclasses
import hashlib
import os
import sys
import time

import torch

import backend
import cpu
import model as model_py
import gpu
import quantize
import ranks
import tp
from checkpoint import (Checkpoint, InputError, map_safetensors, no_random_init, open_checkpoint, release_file_pages,
                        write_atomically)
from model import Transformer
from speculative import ModelDrafter, NgramDrafter, ranked_vocabulary
from tokenizer import Tokenizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
BACKENDS = ("auto", "torch", "aten")  # aten: CUDA only, to compare (gpu.py)


def check_device(device):
    """cpu or cuda[:N], and present."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise InputError(f"--device {device}: not supported; use cpu or cuda")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"--device {device}: not available ({reason[:160]})") from None


def load_model(checkpoint_path, device="cpu", dtype=torch.bfloat16, tp_group=None, backend="auto",
               phases=None, head_rows=None) -> Transformer:
    """`checkpoint_path`: a directory, a .safetensors file in one, or a checkpoint.Checkpoint (resolved and read once).
    Build on the meta device, then assign the mapped tensors: the weights are never held twice.
    A file written by quantize.py carries its mode in the metadata and gets quantized modules.
    With a process group (torchrun), tp.py slices the mapped tensors first, so each rank copies only its shard.
    backend "auto": the backend of the device serves what it proves to compute as model.py does (apply_backend);
    "torch": model.py alone. `phases`: a dict that gets the seconds each part of the load took. head_rows: the token
    ids [N] whose rows the LM head keeps (a draft's trimmed vocabulary: its logits are then over those N), or None."""
    phases = {} if phases is None else phases
    start = time.perf_counter()
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend}: unknown; use {' or '.join(BACKENDS)}")
    checkpoint = open_checkpoint(checkpoint_path)
    args, weights_path = checkpoint.args, checkpoint.weights
    mapped, metadata = map_safetensors(weights_path)
    mode, block = quantize.file_mode(metadata, weights_path)
    if mode:
        args = dataclasses.replace(args, tie_embeddings=False)  # quantize.py stores its own LM head
    with torch.device("meta"), no_random_init():
        model = Transformer(args)
        if mode:
            quantize.replace_linears(model, mode, block)
    tensors = stack_products(model, mapped, weights_path)
    expected = model.state_dict()
    if args.tie_embeddings:
        expected.pop("output.weight")
    for name, param in expected.items():
        if name not in tensors:
            raise InputError(f"{weights_path}: missing tensor '{name}' (does config.json match the weights?)")
        if tensors[name].shape != param.shape:
            raise InputError(f"{weights_path}: tensor '{name}' has shape {list(tensors[name].shape)}, config.json "
                             f"implies {list(param.shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise InputError(f"{weights_path}: unexpected tensor '{unexpected[0]}' (does config.json match?)")
    model.load_state_dict({name: tensors[name] for name in expected}, assign=True, strict=False)
    del tensors  # the stacked products' only holder is then the model: a backend's layout of a layer frees them
    model.tie_weights()
    phases["map and build"] = time.perf_counter() - start
    start = time.perf_counter()
    if tp_group is not None:
        tp.apply_tp(model, tp_group)
    model.to(device=device, dtype=dtype)  # floating tensors only; a no-op (still the map) where they match
    if head_rows is not None:
        quantize.keep_outputs(model.output, head_rows.to(device))  # a copy of those rows: a tied head is untied
    phases["shard and cast"] = time.perf_counter() - start
    if backend != "torch":
        apply_backend(model, mapped, phases, backend)
    return model.eval()


def stack_products(model, tensors: dict, path) -> dict:
    """The file's tensors with the products that model.py stacks (model.stacked: q/k/v, gate/up) joined, each tensor
    along its output axis (a file holds them apart), each part checked for the rows config.json implies."""
    tensors = dict(tensors)
    for name, module in model.named_modules():
        for stack, parts in model_py.stacked(model.args).items():
            if not name.endswith(stack) or f"{name}.weight" in tensors:
                continue
            prefix, axes = name.removesuffix(stack), quantize.output_axes(module)
            held = []
            for part, rows in parts:
                keys = [key for key in tensors if key.startswith(f"{prefix}{part}.")]
                if f"{prefix}{part}.weight" not in keys:
                    raise InputError(f"{path}: missing tensor '{prefix}{part}.weight' (does config.json match the "
                                     "weights?)")
                for key in keys:
                    rows_held = tensors[key].shape[axes.get(key.rsplit(".", 1)[1], 0)]
                    if rows_held != rows:
                        raise InputError(f"{path}: tensor '{key}' has {rows_held} output rows, config.json implies "
                                         f"{rows}")
                held.append({key.rsplit(".", 1)[1]: tensors.pop(key) for key in keys})
            try:
                joined = quantize.stack_outputs(module, held)
            except (KeyError, RuntimeError) as e:
                raise InputError(f"{path}: the parts of {name} do not stack ({str(e).splitlines()[0]}); does "
                                 "config.json match the weights?") from None
            release_file_pages(t for part in held for t in part.values())  # copied: the process needs their pages no more
            tensors.update({f"{name}.{k}": t for k, t in joined.items()})
    return tensors


def apply_backend(model, mapped=None, phases=None, name="auto") -> backend.Report:
    """The backend of the model's device, around model.py: cpu/ on CPU, gpu.py on CUDA (each checks itself and
    returns its report, which it keeps with the model: backend.report(model)). name "aten": CUDA's aten kernels."""
    device = model.tok_embeddings.weight.device.type
    if name == "aten" and device != "cuda":
        raise InputError(f"--backend aten runs CUDA's aten kernels (to compare with the Triton ones); on {device} use "
                         "auto or torch")
    if device == "cpu":
        return cpu.apply(model, mapped, phases)
    if device == "cuda":
        return gpu.apply(model, name)
    return backend.report(model)


DRAFT_FORMS = ("auto", "none", *quantize.MODES)


def draft_mode(form, backend="auto") -> str | None:
    """The quantize.py mode a full-precision draft runs in: auto is int4 where a backend serves its products (on
    model.py's PyTorch path an int4 product dequantizes its weight at every call, slower than bf16), none keeps it."""
    if form not in DRAFT_FORMS:
        raise InputError(f"--draft_quantize {form}: unknown; use {', '.join(DRAFT_FORMS)}")
    if form == "auto":
        return "int4" if backend != "torch" else None
    return None if form == "none" else form


def load_draft(checkpoint, device="cpu", dtype=torch.bfloat16, backend="auto", form="auto", phases=None,
               say=None, vocabulary=None):
    """The draft model, in its cheapest good form: its bits change which drafts the target accepts, never the
    output. A full-precision draft runs as draft_mode(form): quantize.py's copy beside it where one is current, else
    written there once (marked written_for "draft": only such a file is ever replaced, never a user's), else, where
    that cannot be written, quantized in memory. vocabulary: the token ids its LM head keeps (draft_vocabulary), or
    None for all. Returns (model, the form that runs: "int4 (FILE)", "bf16", ...)."""
    phases = {} if phases is None else phases
    say = say or (lambda line: print(line, file=sys.stderr))
    checkpoint = open_checkpoint(checkpoint)
    ckpt_dir, weights_path = checkpoint.directory, checkpoint.weights
    mode = draft_mode(form, backend)
    own_mode = quantize.file_mode(map_safetensors(weights_path)[1], weights_path)[0]
    if own_mode and form not in ("auto", "none", own_mode):
        raise InputError(f"--draft_quantize {form}: {weights_path} is already {own_mode}; give the draft's "
                         "full-precision model.safetensors, or drop the flag")
    if mode and not own_mode and not quantize_fits(checkpoint.args, mode):
        if form != "auto":
            raise InputError(f"--draft_quantize {form}: {ckpt_dir}'s layers do not fit {mode} (see quantize.py); "
                             "use auto or none")
        mode = None  # a draft too small for int4's groups runs as it is
    load = dict(device=device, dtype=dtype, backend=backend, phases=phases, head_rows=vocabulary)
    if own_mode or mode is None:
        model = load_model(checkpoint, **load)
        return model, own_mode or {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    copy = ckpt_dir / f"model.{mode}.safetensors"
    start = time.perf_counter()
    if ranks.is_rank0() and not quantize.current_copy(copy, weights_path, mode) and draft_copy_may_be_written(copy):
        say(f"draft: writing its {mode} copy {copy} (once; a draft's bits change only which drafts are accepted, "
            f"never the output; --draft_quantize none keeps it as it is)")
        try:
            quantize.quantize_checkpoint(checkpoint, mode, output=copy, written_for="draft")
        except (InputError, OSError) as e:
            say(f"draft: {copy} not written ({str(e).splitlines()[0][:160]}); quantizing it in memory")
        phases["quantize"] = time.perf_counter() - start
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the other ranks map what rank 0 wrote
    if quantize.current_copy(copy, weights_path, mode):
        return load_model(checkpoint.with_weights(copy), **load), f"{mode} ({copy})"
    if ranks.is_rank0():  # a file of that name that the loader did not write is in the way, or it cannot write there
        say(f"draft: quantizing it to {mode} in memory at every load: {copy} is not its current {mode} copy and "
            "is not the loader's to replace (run quantize.py into it, or remove it, to keep a copy)"
            if copy.exists() else f"draft: quantizing it to {mode} in memory ({ckpt_dir} is not writable)")
    start = time.perf_counter()
    model = load_model(checkpoint, device, dtype, backend="torch", phases=phases)
    quantize.quantize_model(model, mode)
    if vocabulary is not None:
        quantize.keep_outputs(model.output, vocabulary.to(device))
    phases["quantize"] = phases.get("quantize", 0.0) + time.perf_counter() - start
    if backend != "torch":
        apply_backend(model, None, phases, backend)
    return model, f"{mode} (in memory)"


# The tokens a draft proposes among by default: all of them. Trimmed to a code model's 32768 likeliest (--draft_vocab)
# a draft step of the Qwen pair's 0.5B reads 22% fewer bytes at 1.5% less alpha on HumanEval, but halves alpha on
# German and Chinese text, whose tokens the ranking's text lacks (docs/performance.md).
DRAFT_VOCAB = None
VOCAB_FILE = "draft_vocab.safetensors"  # a draft's ranked vocabulary, written beside it once (draft_vocabulary)
VOCAB_MARK = "fastdecode draft vocabulary"


def draft_vocabulary(checkpoint, size, say=None) -> torch.Tensor | None:
    """The `size` likeliest token ids of a draft's vocabulary, ascending (None where that is all of it): the ranking
    speculative.ranked_vocabulary counts (a few seconds) is written beside the draft once, as draft_vocab.safetensors
    with this loader's mark and its tokenizer's hash, and read by later loads; a file of that name the loader did
    not write is never replaced (the ranking is then counted in memory)."""
    checkpoint = open_checkpoint(checkpoint)
    vocab_size = checkpoint.args.vocab_size
    if size is None or size >= vocab_size:
        return None
    if size < 16 or size % 16:
        raise InputError(f"--draft_vocab {size}: a multiple of 16 (the products' column tiles), at least 16, or all")
    say = say or (lambda line: print(line, file=sys.stderr))
    path, tokenizer = checkpoint.directory / VOCAB_FILE, Tokenizer(checkpoint.directory, checkpoint.config)
    tokenizer_hash = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
    try:
        tensors, meta = map_safetensors(path) if path.exists() else ({}, {})
    except InputError:  # not a safetensors file: not the loader's
        tensors, meta = {}, {}
    mine = not path.exists() or meta.get("written_by") == VOCAB_MARK
    ranked = None
    if mine and meta.get("tokenizer_sha256") == tokenizer_hash and \
            list(tensors.get("ranked", torch.empty(0)).shape) == [vocab_size]:
        ranked = tensors["ranked"].long()
    if ranked is None:
        start = time.perf_counter()
        ranked, counted = ranked_vocabulary(tokenizer, vocab_size)
        if ranks.is_rank0() and mine and os.access(path.parent, os.W_OK):
            from safetensors.torch import save_file
            write_atomically(path, lambda tmp: save_file(
                {"ranked": ranked.to(torch.int32)}, str(tmp),
                metadata=dict(written_by=VOCAB_MARK, counted=counted, tokenizer_sha256=tokenizer_hash)))
            say(f"draft: ranked its vocabulary by {counted} in {time.perf_counter() - start:.1f} s, written to "
                f"{path} (once)")
        elif ranks.is_rank0():
            say(f"draft: ranked its vocabulary in memory ({path} is " +
                ("not the loader's to replace)" if path.exists() else "not writable)"))
    return ranked[:size].sort().values


def quantize_fits(args, mode) -> bool:
    """Whether every Linear of a model of these args has the shape quantize.py's `mode` needs."""
    try:
        with torch.device("meta"), no_random_init():
            quantize.replace_linears(Transformer(args), mode, 32)
        return True
    except InputError:
        return False


def draft_copy_may_be_written(path) -> bool:
    """Absent, or a copy this loader wrote before (quantize.py's metadata mark), in a writable directory."""
    if path.exists():
        return quantize.written_by_quantize(path) and map_safetensors(path)[1].get("written_for") == "draft"
    return os.access(path.parent, os.W_OK)


def make_drafter(kind, checkpoint=None, device="cpu", dtype=torch.bfloat16, backend="auto", compile=False,
                 phases=None, form="auto", say=None, vocab=DRAFT_VOCAB):
    """A drafter: "model" (the draft model at `checkpoint` in the form load_draft gives it, its LM head over its
    `vocab` likeliest tokens (None: all), loaded replicated under tensor parallelism; drafter.form says which),
    "ngram" (prompt lookup), or None for none."""
    if kind == "ngram":
        return NgramDrafter()
    if kind is None:
        return None
    start = time.perf_counter()
    vocabulary = draft_vocabulary(checkpoint, vocab, say)
    if phases is not None and vocabulary is not None:
        phases["vocabulary"] = time.perf_counter() - start
    draft, form = load_draft(checkpoint, device, dtype, backend, form, phases, say, vocabulary)
    if vocabulary is not None:
        form += f", proposing among {len(vocabulary)} of {draft.args.vocab_size} tokens"
    return ModelDrafter(draft, compile=compile, form=form,
                        vocabulary=None if vocabulary is None else vocabulary.to(draft.tok_embeddings.weight.device))


# ---------------------------------------------------------------- the model flags (generate.py's and serve.py's)

def speculate_k_arg(value: str):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"'{value}' is not a positive integer or 'auto'")
    return int(value)


def draft_vocab_arg(value: str):
    if value == "all":
        return None
    if not value.isdigit() or int(value) < 16 or int(value) % 16:
        raise argparse.ArgumentTypeError(f"'{value}' is not 'all' or a multiple of 16, at least 16")
    return int(value)


def add_model_flags(p):
    """The flags that say which model runs and how: generate.py's and serve.py's."""
    p.add_argument("--checkpoint_path", required=True, help="checkpoint directory or its .safetensors file")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode and verify steps (model.py's "
                   "forward around the backend's kernels; a cold compile takes tens of seconds, a cached one a few)")
    p.add_argument("--compile_prefill", action="store_true", help="torch.compile prefill (dynamic shapes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp32 or fp16")
    p.add_argument("--backend", default="auto", help="auto (default): on CPU the few_rows.cpp kernels serve the "
                   "model where they prove to compute what model.py computes; torch: model.py's PyTorch alone")
    p.add_argument("--verbose", action="store_true", help="say what loading took, phase by phase, and what the "
                   "backend serves")
    p.add_argument("--draft_checkpoint", help="speculative decoding with this draft model (same tokenizer)")
    p.add_argument("--draft_quantize", default=None, help="the form a full-precision draft model runs in: auto "
                   "(default: int4, written once beside it as quantize.py's model.int4.safetensors; with --backend "
                   "torch, as it is), none (as it is) or a quantize.py mode. It changes which drafts are accepted, "
                   "never the output")
    p.add_argument("--draft", choices=["model", "ngram"], default=None,
                   help="drafter: model (needs --draft_checkpoint) or ngram (prompt lookup, no model)")
    p.add_argument("--speculate_k", type=speculate_k_arg, default=5,
                   help="tokens drafted per speculative round, or 'auto': each round drafts while the draft is sure "
                   "(its threshold learned from measured acceptance and costs)")
    p.add_argument("--draft_vocab", type=draft_vocab_arg, default=DRAFT_VOCAB,
                   help="all (default), or N: the draft model proposes among its N likeliest tokens (its LM head's "
                   "rows; ranked once by their counts in the Python standard library's source): a cheaper draft "
                   "step for code and English, fewer accepted drafts for other text. It changes which drafts are "
                   "accepted, never the output")
    p.add_argument("--nproc_per_node", type=int, default=1, help="tensor parallelism: this many ranks on this host "
                   "(as torchrun starts them; gloo on CPU, NCCL with one GPU each)")


def check_model_options(opts):
    """add_model_flags' flags, before anything loads."""
    if opts.dtype not in DTYPES:
        raise InputError(f"--dtype {opts.dtype}: unknown; use bf16, fp32 or fp16")
    if opts.backend not in BACKENDS:
        raise InputError(f"--backend {opts.backend}: unknown; use {' or '.join(BACKENDS)}")
    if opts.draft == "model" and not opts.draft_checkpoint:
        raise InputError("--draft model needs --draft_checkpoint PATH")
    if opts.draft == "ngram" and opts.draft_checkpoint:
        raise InputError("--draft ngram uses no model; drop --draft_checkpoint (or use --draft model)")
    if opts.draft_quantize is not None:
        if not opts.draft_checkpoint:
            raise InputError("--draft_quantize applies to a draft model; give --draft_checkpoint PATH or drop it")
        draft_mode(opts.draft_quantize, opts.backend)
    if opts.draft_vocab is not None and not opts.draft_checkpoint:
        raise InputError("--draft_vocab applies to a draft model; give --draft_checkpoint PATH or drop it")
    if opts.nproc_per_node < 1:
        raise InputError(f"--nproc_per_node {opts.nproc_per_node}: must be at least 1")
    check_device(opts.device)
    if torch.device(opts.device).type == "cuda" and opts.nproc_per_node > torch.cuda.device_count():
        raise InputError(f"--nproc_per_node {opts.nproc_per_node}: this host has {torch.cuda.device_count()} GPUs; "
                         "launch at most one rank per GPU")


def check_draft(opts, tokenizer, target: Checkpoint) -> Checkpoint | None:
    """The draft checkpoint's files, tokenizer and vocabulary, before any model is loaded: the draft resolved and its
    config read, once (make_drafter takes it), or None."""
    if not opts.draft_checkpoint:
        return None
    try:
        draft = open_checkpoint(opts.draft_checkpoint)
    except InputError as e:
        raise InputError(f"--draft_checkpoint {opts.draft_checkpoint}: {e}") from None
    draft_tokenizer = Tokenizer(draft.directory, draft.config)
    if not tokenizer.same_vocabulary(draft_tokenizer):
        raise InputError(f"{draft_tokenizer.path}: the draft's tokenizer differs from the target's "
                         f"({tokenizer.path}); speculation needs the same vocabulary")
    if draft.args.vocab_size != target.args.vocab_size:
        raise InputError(f"{draft.directory / 'config.json'}: vocab_size {draft.args.vocab_size} differs from the "
                         f"target's {target.args.vocab_size}; speculation needs the same vocabulary")
    return draft
