"""The canary's verdict, remembered on disk per (weights, code, CPU, torch), so that a model pays for its canary once,
not at every load."""
import dataclasses
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

import torch

import cpu.canary as canary
import cpu.gate as gate
import cpu.kernels as kernels

# The modules whose code the verdict depends on: model.py's math, the quantized forms, the backend itself.
CODE_MODULES = ("model", "quantize", "mx", "tp", "cpu", "cpu.gate", "cpu.canary", "cpu.serving", "cpu.verdicts",
                "cpu.modules", "cpu.one_call", "cpu.huge_pages", "cpu.kernels")


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
    digest.update(repr((build, torch.__version__, sys.version, dataclasses.asdict(transformer.args), gate.REPLACED,
                        gate.ONE_CALL, canary.TOLERANCE, canary.ONE_CALL_FP32, canary.TOKENS)).encode())
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
