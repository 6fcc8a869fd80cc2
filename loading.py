"""Loading a converted checkpoint: config.json, the mapped safetensors file (plain or quantize.py's), tensor
parallelism, dtype and device, then the backend of that device (cpu/ or gpu.py), whose report says what it serves
(backend.report). What generate.py, the scripts and the tests load models with.
"""
import dataclasses
import time

import torch

import backend
import cpu
import gpu
import quantize
import tp
from checkpoint import InputError, map_safetensors, no_random_init, read_model_args, resolve_checkpoint
from model import Transformer
from speculative import ModelDrafter, NgramDrafter

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
BACKENDS = ("auto", "torch")


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
               phases=None) -> Transformer:
    """Build on the meta device, then assign the mapped tensors: the weights are never held twice.
    A file written by quantize.py carries its mode in the metadata and gets quantized modules.
    With a process group (torchrun), tp.py slices the mapped tensors first, so each rank copies only its shard.
    backend "auto": the backend of the device serves what it proves to compute as model.py does (apply_backend);
    "torch": model.py alone. `phases`: a dict that gets the seconds each part of the load took."""
    phases = {} if phases is None else phases
    start = time.perf_counter()
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend}: unknown; use {' or '.join(BACKENDS)}")
    ckpt_dir, weights_path = resolve_checkpoint(checkpoint_path)
    args = read_model_args(ckpt_dir / "config.json")
    tensors, metadata = map_safetensors(weights_path)
    mode, block = quantize.file_mode(metadata, weights_path)
    if mode:
        args = dataclasses.replace(args, tie_embeddings=False)  # quantize.py stores its own LM head
    with torch.device("meta"), no_random_init():
        model = Transformer(args)
        if mode:
            quantize.replace_linears(model, mode, block)
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
    model.tie_weights()
    phases["map and build"] = time.perf_counter() - start
    start = time.perf_counter()
    if tp_group is not None:
        tp.apply_tp(model, tp_group)
    model.to(device=device, dtype=dtype)  # floating tensors only; a no-op (still the map) where they match
    phases["shard and cast"] = time.perf_counter() - start
    if backend == "auto":
        apply_backend(model, tensors, phases)
    return model.eval()


def apply_backend(model, mapped=None, phases=None) -> backend.Report:
    """The backend of the model's device, around model.py: cpu/ on CPU, gpu.py on CUDA (each checks itself and
    returns its report, which it keeps with the model: backend.report(model))."""
    device = model.tok_embeddings.weight.device.type
    if device == "cpu":
        return cpu.apply(model, mapped, phases)
    if device == "cuda":
        return gpu.apply(model)
    return backend.report(model)


def verify_limit(device, backend="auto") -> int | None:
    """The longest verify (K + 1 tokens a row) that the backend a model on `device` would get computes exactly, known
    before it loads (its report says so after: backend.Report.max_verify_tokens); None: no limit."""
    return cpu.MAX_VERIFY_TOKENS if backend == "auto" and torch.device(device).type == "cpu" else None


def make_drafter(kind, checkpoint=None, device="cpu", dtype=torch.bfloat16, backend="auto", compile=False,
                 phases=None):
    """A drafter: "model" (the draft model at `checkpoint`, loaded replicated under tensor parallelism), "ngram"
    (prompt lookup), or None for none."""
    if kind == "ngram":
        return NgramDrafter()
    if kind is None:
        return None
    draft = load_model(checkpoint, device, dtype, backend=backend, phases=phases)
    return ModelDrafter(draft, compile=compile)
