"""Export a checkpoint for Qualcomm Cloud AI 100: an ONNX graph with retained-state KV, plus the compiler's side files.

    python scripts/export_qaic.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --output_dir qaic/target \
        --role target --speculate_k 7 --ctx_len 256 --prefill_len 32 [--mxfp6]

The graph is model.py's Transformer behind a thin wrapper: each layer's KV cache becomes a pair of graph inputs,
`past_key.{i}` / `past_value.{i}` [batch_size, n_kv_heads, ctx_len, head_dim], updated by a scatter at
`position_ids` and returned as `past_key.{i}_RetainedState` / `past_value.{i}_RetainedState`, which the compiler's
-retained-state keeps on the card. The mask comes from `position_ids` (a query at p sees slots 0..p). Padding
positions are -1: they write nothing (they scatter the last slot's old value back onto it) and read slot 0, so
their logits are finite garbage that the host ignores.

Roles: the target returns logits for every position ([B, seq_len, V]: K + 1 of them in its decode specialization,
the verify step); the draft returns only the last valid position's ([B, 1, V]). The output directory is
self-contained: model.onnx and model.onnx.data, specializations.json, custom_io.yaml, qaic.json (what
scripts/run_onnx.py needs), config.json and the tokenizer. Weights stay fp32 here; the compiler converts to fp16
and, with --mxfp6, compresses the MatMul weights to MXFP6 E2M3 (-mxfp6-matmul). So export the float checkpoint:
a quantize.py file is refused.
"""
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import quantize  # noqa: E402
from checkpoint import InputError, OneLineErrors, resolve_checkpoint  # noqa: E402
from generate import load_model  # noqa: E402
from model import Transformer  # noqa: E402

FP16_MAX = float(np.finfo(np.float16).max)
OPSET = 17


class RetainedStateKV(nn.Module):
    """Stands in for model.KVCache: the cache tensors are graph inputs, and the updated ones graph outputs."""

    def __init__(self):
        super().__init__()
        self.k_cache = self.v_cache = self.slots = self.is_padding = None  # set per call by QaicExport

    def update(self, input_pos, k, v):
        self.k_cache = self.scatter(self.k_cache, k)
        self.v_cache = self.scatter(self.v_cache, v)
        return self.k_cache, self.v_cache

    def scatter(self, cache, new):
        # cache [B, H, L, D], new [B, T, H, D]: one ScatterND at the (row, head, slot) index triples [B, H, T, 3]
        B, H = cache.shape[:2]
        index = (torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], self.slots[:, None, :])
        new = torch.where(self.is_padding[:, None, :, None], cache[index], new.transpose(1, 2))
        return cache.index_put(index, new)


class QaicExport(nn.Module):
    def __init__(self, model: Transformer, role: str):
        super().__init__()
        self.model, self.role = model, role
        self.caches = nn.ModuleList(RetainedStateKV() for _ in model.layers)
        for layer, cache in zip(model.layers, self.caches):
            layer.attention.kv_cache = cache

    def forward(self, input_ids, position_ids, *past):
        is_padding = position_ids < 0
        slots = torch.where(is_padding, past[0].shape[2] - 1, position_ids)
        for i, cache in enumerate(self.caches):
            cache.k_cache, cache.v_cache, cache.slots, cache.is_padding = past[2 * i], past[2 * i + 1], slots, is_padding
        # the last valid position: positions increase along a row and padding (-1) sits on the right
        logits_idx = position_ids.argmax(1, keepdim=True) if self.role == "draft" else None
        logits = self.model(input_ids, position_ids.clamp(min=0), logits_idx)
        return (logits, *(t for cache in self.caches for t in (cache.k_cache, cache.v_cache)))


def io_names(n_layers: int):
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", *past], ["logits", *(f"{name}_RetainedState" for name in past)]


def check_options(opts):
    if opts.speculate_k < 1:
        raise InputError(f"--speculate_k {opts.speculate_k}: must be at least 1")
    if opts.role == "target" and opts.speculate_k + 1 > opts.prefill_len:
        raise InputError(f"--speculate_k {opts.speculate_k} needs a decode of {opts.speculate_k + 1} positions, longer "
                         f"than --prefill_len {opts.prefill_len}; raise --prefill_len or lower --speculate_k")
    if opts.prefill_len < 1 or opts.prefill_len > opts.ctx_len:
        raise InputError(f"--prefill_len {opts.prefill_len} must lie in 1..--ctx_len ({opts.ctx_len})")
    if opts.batch_size < 1:
        raise InputError(f"--batch_size {opts.batch_size}: must be at least 1")


def load_float_model(checkpoint_path, ctx_len: int) -> Transformer:
    model = load_model(checkpoint_path, "cpu", torch.float32, backend="torch")  # the graph is model.py
    if any(isinstance(m, (quantize.Int8Linear, quantize.Int4Linear, quantize.MXLinear)) for m in model.modules()):
        _, weights = resolve_checkpoint(checkpoint_path)
        raise InputError(f"{weights}: a quantize.py checkpoint; export the float model.safetensors (--mxfp6 "
                         "lets the compiler compress the weights)")
    if ctx_len > model.args.max_seq_len:
        raise InputError(f"--ctx_len {ctx_len} exceeds the model's context (config.json max_seq_len "
                         f"{model.args.max_seq_len})")
    model.setup_caches(1, ctx_len)  # the rotary tables for ctx_len positions; the caches are replaced
    return model


def export_onnx(model: Transformer, role: str, ctx_len: int, path: Path):
    # The TorchScript exporter: it writes opset 17 natively (the compiler takes 13..17), where the dynamo exporter
    # starts at 18 and its down-conversion fails (Split's num_outputs).
    args = model.args
    inputs, outputs = io_names(args.n_layers)
    axes = {"input_ids": {0: "batch_size", 1: "seq_len"}, "position_ids": {0: "batch_size", 1: "seq_len"},
            "logits": {0: "batch_size", 1: "seq_len"} if role == "target" else {0: "batch_size"}}
    axes.update({name: {0: "batch_size", 2: "ctx_len"} for name in inputs[2:] + outputs[1:]})
    B, T = 2, 3  # examples away from 1, so no dimension is taken for a broadcast
    kv_shape = (B, args.n_kv_heads, ctx_len, args.head_dim)
    example = (torch.zeros(B, T, dtype=torch.long), torch.arange(T).repeat(B, 1),
               *(torch.zeros(kv_shape) for _ in range(2 * args.n_layers)))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(QaicExport(model, role), example, str(path), dynamo=False, input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=OPSET)


def finish_graph(path: Path, role: str):
    """Name the dynamic dimensions as the specializations do, and clip float constants to the float16 range."""
    import onnx
    from onnx import numpy_helper
    graph_model = onnx.load(str(path))
    graph = graph_model.graph
    symbols = {"input_ids": ("batch_size", "seq_len"), "position_ids": ("batch_size", "seq_len"),
               "logits": ("batch_size", "seq_len" if role == "target" else 1, None)}
    for value in [*graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        names = symbols.get(value.name, ("batch_size", None, "ctx_len", None))
        for dim, name in zip(dims, names):
            if isinstance(name, str):
                dim.dim_param = name
            elif name is not None:
                dim.dim_value = name
    del graph.value_info[:]  # the exporter's own symbol names; shapes are re-inferred by the consumers
    clipped = 0

    def clip(tensor):
        nonlocal clipped
        array = numpy_helper.to_array(tensor)
        if array.dtype in (np.float32, np.float64) and np.abs(array).max(initial=0) > FP16_MAX:
            clipped += 1
            tensor.CopyFrom(numpy_helper.from_array(np.clip(array, -FP16_MAX, FP16_MAX), tensor.name))

    for tensor in graph.initializer:
        clip(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                clip(attr.t)
    path.with_name(path.name + ".data").unlink(missing_ok=True)
    onnx.save(graph_model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=1024)
    onnx.checker.check_model(str(path))  # by path: the checker reads the external data too
    return clipped


def side_files(out: Path, opts, args):
    decode_len = opts.speculate_k + 1 if opts.role == "target" else 1
    entries = [dict(batch_size=str(opts.batch_size), seq_len=str(n), ctx_len=str(opts.ctx_len))
               for n in (opts.prefill_len, decode_len)]
    (out / "specializations.json").write_text(json.dumps({"specializations": entries}, indent=1) + "\n")
    precision = "mxint8" if opts.mxint8_kv else "float16"
    _, outputs = io_names(args.n_layers)
    kv = [name.removesuffix("_RetainedState") for name in outputs[1:]]
    lines = [f" - IOName: {name}\n   Precision: {precision}\n" for name in kv + outputs[1:]]
    (out / "custom_io.yaml").write_text("".join(lines))
    meta = dict(role=opts.role, batch_size=opts.batch_size, prefill_len=opts.prefill_len, decode_len=decode_len,
                ctx_len=opts.ctx_len, n_layers=args.n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                vocab_size=args.vocab_size)
    (out / "qaic.json").write_text(json.dumps(meta, indent=1) + "\n")


def compile_command(out: Path, mxfp6: bool) -> str:
    return " ".join(["/opt/qti-aic/exec/qaic-exec", "-aic-hw", "-aic-hw-version=2.0", f"-m={out / 'model.onnx'}",
                     "-compile-only", "-retained-state", "-convert-to-fp16", *(["-mxfp6-matmul"] if mxfp6 else []),
                     "-aic-num-cores=16", f"-network-specialization-config={out / 'specializations.json'}",
                     f"-custom-IO-list-file={out / 'custom_io.yaml'}", f"-aic-binary-dir={out / 'qpc'}"])


def export(opts) -> Path:
    check_options(opts)
    ckpt_dir, _ = resolve_checkpoint(opts.checkpoint_path)
    model = load_float_model(opts.checkpoint_path, opts.ctx_len)
    out = Path(opts.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside the destination and renamed into place: an interrupted export leaves no half directory
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        start = time.perf_counter()
        print(f"exporting {opts.role} ({model.args.n_layers} layers) to ONNX ...", file=sys.stderr)
        export_onnx(model, opts.role, opts.ctx_len, work / "model.onnx")
        clipped = finish_graph(work / "model.onnx", opts.role)
        side_files(work, opts, model.args)
        for name in ("config.json", "tokenizer.json", "tokenizer.model"):
            if (ckpt_dir / name).is_file():
                shutil.copy(ckpt_dir / name, work / name)
        for path in [work, *work.iterdir()]:  # mkdtemp made it private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"exported in {time.perf_counter() - start:.0f} s; {clipped} float constants clipped to the float16 range",
          file=sys.stderr)
    print(compile_command(out, opts.mxfp6))
    return out


def build_parser():
    p = OneLineErrors(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint_path", required=True, help="checkpoint directory or its model.safetensors")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--role", choices=["target", "draft"], default="target")
    p.add_argument("--speculate_k", type=int, default=7, help="draft tokens per round; the target verifies K + 1")
    p.add_argument("--ctx_len", type=int, default=256, help="KV cache slots: prompt + new tokens + K must fit")
    p.add_argument("--prefill_len", type=int, default=32, help="prompt chunk per prefill call")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--mxfp6", action="store_true", help="compile with -mxfp6-matmul (MXFP6 E2M3 weights)")
    p.add_argument("--mxint8_kv", action="store_true", help="MXINT8 KV cache on the card instead of float16")
    return p


def main(argv=None):
    opts = build_parser().parse_args(argv)
    try:
        export(opts)
    except InputError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
