"""Checkpoint files: bad input as one line, config.json and the model's shape read from it (checked), resolving
paths, the bounds-checked safetensors map, and writes that are never left half-done. What loading.py, quantize.py
and the scripts share; imports only cli.py and model.py of this project.
"""
import contextlib
import ctypes
import dataclasses
import json
import math
import mmap
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from cli import InputError, OneLineErrors  # noqa: F401 (re-exported: the library's error type)
from model import ModelArgs


def read_json_object(path, fix: str) -> dict:
    """A JSON object file as a dict, or one InputError naming the file and `fix`: unreadable, not JSON, or not an
    object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InputError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object but {type(value).__name__}; {fix}")
    return value


def read_config(path) -> dict:
    """config.json as a dict, or one InputError naming the file: missing, not JSON, or not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: not found; convert the model with scripts/convert_checkpoint.py")
    return read_json_object(path, "re-run scripts/convert_checkpoint.py")


def read_model_args(path) -> ModelArgs:
    """The model's shape and math from config.json, every field checked: one InputError naming the file and the
    field where one is missing or wrong."""
    return model_args(read_config(path), path)


def model_args(config: dict, path="config.json") -> ModelArgs:
    """ModelArgs from config.json's dict, every field checked (read_model_args)."""
    path = Path(path)
    fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
    missing = [name for name in fields if name not in ModelArgs.OPTIONAL and name not in config]
    if missing:
        raise InputError(f"{path}: missing field '{missing[0]}'; re-run scripts/convert_checkpoint.py")
    values = {name: config.get(name, field.default) for name, field in fields.items()}
    check_model_args(values, path)
    return ModelArgs(**values)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_model_args(values: dict, path="config.json"):
    """ModelArgs' fields as config.json gives them (the optional ones may be left out): what model.py implements, or
    one InputError naming the field."""
    values = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING} \
        | values
    def bad(name, want):
        return InputError(f"{path}: field '{name}' must be {want}, not {values[name]!r}; fix the file or re-run "
                          "scripts/convert_checkpoint.py")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len"):
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(name, "a positive integer")
    if not is_number(values["norm_eps"]) or values["norm_eps"] < 0:
        raise bad("norm_eps", "a finite number >= 0")
    if not is_number(values["rope_theta"]) or values["rope_theta"] <= 0:
        raise bad("rope_theta", "a finite number > 0")
    for name in ("tie_embeddings", "qkv_bias"):
        if not isinstance(values[name], bool):
            raise bad(name, "true or false")
    if values["family"] not in ("llama", "gemma3", "codegen"):
        raise InputError(f"{path}: family '{values['family']}' is not supported; use 'llama', 'gemma3' or 'codegen'")
    if not isinstance(values["qk_norm"], bool):
        raise bad("qk_norm", "true or false")
    dim, n_heads, n_kv_heads, head_dim = values["dim"], values["n_heads"], values["n_kv_heads"], values["head_dim"]
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2
                                 or head_dim % 2):
        raise bad("head_dim", "a positive even integer (or absent: dim / n_heads)")
    if (head_dim is None and dim % n_heads) or n_heads % n_kv_heads:
        raise InputError(f"{path}: dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads} are inconsistent "
                         "(dim % n_heads, where head_dim is absent, and n_heads % n_kv_heads must be 0)")
    rotary_dim, head_dim = values["rotary_dim"], head_dim or dim // n_heads
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim < 2
                                   or rotary_dim % 2 or rotary_dim > head_dim):
        raise InputError(f"{path}: rotary_dim {rotary_dim!r} must be even and <= head dim {head_dim}")
    for name in ("query_pre_attn_scalar", "rope_local_theta"):
        if values[name] is not None and (not is_number(values[name]) or values[name] <= 0):
            raise bad(name, "a finite number > 0 (or absent)")
    layer_types, window = values["layer_types"], values["sliding_window"]
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != values["n_layers"]
                                    or not set(layer_types) <= {"full_attention", "sliding_attention"}):
        raise bad("layer_types", f"a list of n_layers ({values['n_layers']}) 'full_attention' or 'sliding_attention' "
                                 "(or absent: all full)")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise bad("sliding_window", "a positive integer (or absent)")
    if layer_types and "sliding_attention" in layer_types and window is None:
        raise InputError(f"{path}: layer_types names sliding layers but field 'sliding_window' is absent; fix the "
                         "file or re-run scripts/convert_checkpoint.py")
    scaling = values["rope_scaling"]
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if not isinstance(scaling, dict) or kind not in (None, "default", "llama3", "linear"):
            raise InputError(f"{path}: rope_scaling {scaling!r} is not supported (only 'llama3' and 'linear')")
        if kind == "linear" and not (is_number(scaling.get("factor")) and scaling["factor"] > 0):
            raise InputError(f"{path}: rope_scaling of type linear needs a positive number factor; got {scaling!r}")
        if kind == "llama3" and not all(is_number(scaling.get(key)) and scaling[key] > 0 for key in LLAMA3_SCALING):
            raise InputError(f"{path}: rope_scaling of type llama3 needs positive numbers "
                             f"{', '.join(LLAMA3_SCALING)}; got {scaling!r}")


def resolve_checkpoint(path) -> tuple[Path, Path]:
    """A checkpoint directory or a .safetensors file inside one -> (directory, weights file)."""
    path = Path(path)
    if path.is_dir():
        weights = path / "model.safetensors"
    else:
        weights, path = path, path.parent
        if weights.exists() and weights.suffix != ".safetensors":
            raise InputError(f"{weights}: expected a checkpoint directory or a .safetensors file")
    if not weights.is_file():
        raise InputError(f"{weights}: not found; convert a model first with scripts/convert_checkpoint.py")
    return path, weights


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint resolved once: its directory, the weights file to load and config.json (read once, checked)."""
    directory: Path
    weights: Path
    args: ModelArgs
    config: dict  # config.json as read: the tokenizer's special ids too

    def with_weights(self, weights: Path) -> "Checkpoint":
        """Another weights file of the same model (quantize.py's copy beside it)."""
        return dataclasses.replace(self, weights=Path(weights))


def open_checkpoint(path) -> Checkpoint:
    """A checkpoint directory or a .safetensors file inside one (or a Checkpoint, as it is) -> Checkpoint."""
    if isinstance(path, Checkpoint):
        return path
    directory, weights = resolve_checkpoint(path)
    config = read_config(directory / "config.json")
    return Checkpoint(directory, weights, model_args(config, directory / "config.json"), config)


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def map_safetensors(path: Path) -> tuple[dict, dict]:
    """Map a safetensors file read-only: tensors are views of the page cache, never a second copy. Every header
    entry is checked (a JSON object of dtype, shape and data_offsets inside the file) before it is used."""
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", buffer[:8])
        if header_len > len(buffer) - 8:
            raise ValueError("header length exceeds the file size")
        header = json.loads(buffer[8:8 + header_len])
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise InputError(f"{path}: corrupt or truncated safetensors file ({e}); re-create it") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: the header is not a JSON object; the file is corrupt, re-create it")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: __metadata__ is not an object of strings; the file is corrupt, re-create it")
    tensors, base = {}, 8 + header_len
    for name, info in header.items():
        if not isinstance(info, dict):
            raise InputError(f"{path}: '{name}' is not a tensor entry; the file is corrupt, re-create it")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise InputError(f"{path}: tensor '{name}' has no valid data_offsets; the file is corrupt, re-create it")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise InputError(f"{path}: tensor '{name}' has no valid shape; the file is corrupt, re-create it")
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise InputError(f"{path}: tensor '{name}' has unsupported dtype {info.get('dtype')!r}")
        start, end = offsets
        count = end - start
        if base + end > len(buffer) or count != torch.Size(shape).numel() * dtype.itemsize:
            raise InputError(f"{path}: tensor '{name}' lies outside the file or has the wrong size; the file "
                             "is truncated or corrupt, re-create it")
        with warnings.catch_warnings():  # the map is read-only; weights are never written in place
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=base + start) if count else \
                torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).view(shape)
    return tensors, metadata


def release_file_pages(mapped):
    """Drop the pages of these tensors of a mapped file from the process (madvise MADV_DONTNEED, Linux): the page
    cache keeps them, and a later read maps the same bytes again, so it is safe for a tensor still in use. The CPU
    backend calls it on each layer once its weights are copied: without it an int8 model's loading peak counted
    its weights twice (298.6 MB against 191.3, measured with a huge-page region per layer)."""
    if sys.platform != "linux":
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    page = mmap.PAGESIZE
    for t in mapped:
        start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor: never a neighbour's
        stop = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if t.numel() and stop > start:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(path: Path, entries: dict, metadata: dict, progress: str | None = None):
    """A safetensors file written tensor by tensor: entries maps name -> (shape, dtype, produce), and produce()
    makes that tensor (cast to dtype here) only when its bytes are written, so a converter holds one tensor at a
    time, not the model. Written under a temporary name and renamed (write_atomically)."""
    from tqdm import tqdm
    header, offset = {"__metadata__": metadata}, 0
    for name, (shape, dtype, _) in entries.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(tmp: Path):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name, (shape, dtype, produce) in tqdm(entries.items(), desc=progress, disable=progress is None,
                                                      unit="tensor"):
                t = produce().to(dtype).contiguous()
                if list(t.shape) != list(shape):
                    raise ValueError(f"{name}: produced shape {list(t.shape)}, declared {list(shape)}")
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    write_atomically(path, write)


def write_atomically(path: Path, write):
    """write(temporary path) in path's directory, then rename it to path: a reader, or a Ctrl-C, never meets a
    half-written file. The file gets the usual permissions (some writers create 0600 files)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def no_random_init():
    """Build modules without their random init, for weights that a file replaces: on the meta device the first
    init call imports torch's decompositions (~1 s of a fresh process's load). Not thread-safe: load one model at
    a time."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in dir(init) if name.endswith("_") and not name.startswith("_")}
    for name in saved:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)
