"""Export a checkpoint for Qualcomm Cloud AI 100: an ONNX graph with retained-state KV, plus the compiler's side files.

    python scripts/export_qaic.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct --output_dir qaic/target \
        --role target --speculate_k 7 --ctx_len 256 --prefill_len 32 [--mxfp6] [--num_cores 11/5]

The graph is model.py's Transformer behind a thin wrapper: each layer's KV cache becomes a pair of graph inputs,
`past_key.{i}` / `past_value.{i}` [batch_size, n_kv_heads, ctx_len, head_dim], updated by a scatter at
`position_ids` and returned as `past_key.{i}_RetainedState` / `past_value.{i}_RetainedState`, which the compiler's
-retained-state keeps on the card. The mask comes from `position_ids` (a query at p sees slots 0..p). Padding
positions are -1 and follow a row's valid ones: they write nothing and their logits are never kept.

The card runs every op in float16, so model.py's norms and attention are swapped for float16-safe forms (each
proved against model.py's forward first). Roles: the target returns the logits of its last N valid positions,
N the length of its `num_logits_to_keep` input (1 in prefill, K + 1 in decode: the verify step); the draft the last
valid position's. The output directory is self-contained: model.onnx and its weights (model.onnx.data, .data.1, ...),
specializations.json, custom_io.yaml, qaic.json (what scripts/run_onnx.py needs), config.json and the tokenizer.
Weights stay fp32 here; the compiler converts to fp16 and, with --mxfp6, compresses the MatMul weights to MXFP6
E2M3 (-mxfp6-matmul). So export the float checkpoint: a quantize.py file is refused. More: docs/cloud-ai-100.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from checkpoint import InputError, OneLineErrors, map_safetensors, read_model_args, resolve_checkpoint  # noqa: E402
from loading import load_model  # noqa: E402
import model as model_lib  # noqa: E402
from model import Transformer  # noqa: E402

TOOL = "scripts/export_qaic.py"

FP16_MAX = float(np.finfo(np.float16).max)
OPSET = 17
DATA_CHUNK_BYTES = 10 * 2**30  # external data files of at most 10 GiB (QEfficient's size), so 7B fp32 is 3 files
CARD_CORES = 16
SUPPORTED_OPS = Path(__file__).resolve().parent / "qaic_ops.json"


class Float16SafeNorm(nn.Module):
    """model.RMSNorm or nn.LayerNorm, computed so that float16 cannot overflow: each row is divided by its largest
    |x| before squaring (x^2 passes float16's 65,504 at |x| = 256; SmolLM2's norm inputs reach 23,852)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, getattr(norm, "bias", None), norm.eps
        self.center = isinstance(norm, nn.LayerNorm)

    def forward(self, x):
        root_eps = math.sqrt(self.eps)
        scale = x.abs().amax(-1, keepdim=True).clamp(min=root_eps)
        z = x / scale  # |z| <= 1
        if self.center:
            z = z - z.mean(-1, keepdim=True)
        # x * rsqrt(mean(x^2) + eps) == z * rsqrt(mean(z^2) + eps / scale^2), and root_eps / scale <= 1
        y = z * torch.rsqrt((z * z).mean(-1, keepdim=True) + (root_eps / scale) ** 2) * self.weight
        return y if self.bias is None else y + self.bias


class ExplicitAttention(model_lib.Attention):
    """model.Attention whose attend is MatMul, Where(mask), Softmax, MatMul: the form the card's compiler takes (the
    attention op is one custom node to the exporter, SDPA's lowering adds IsNaN nodes), with q scaled before the
    product so the scores stay small in float16. Made from a loaded Attention, whose modules and settings it shares."""

    @classmethod
    def of(cls, attention: model_lib.Attention) -> "ExplicitAttention":
        explicit = cls.__new__(cls)
        explicit.__dict__.update(attention.__dict__)
        return explicit

    def attend(self, q, k, v, visible):
        mask = visible[:, None].repeat(1, 1, q.shape[2] // visible.shape[1], 1)
        scores = (q * self.scale) @ k.transpose(-1, -2)
        return torch.where(mask, scores, -FP16_MAX).softmax(-1) @ v


def use_float16_safe_modules(model: Transformer):
    """Swap model.py's norms and attention for the forms above, and prove each swap against model.py's own forward
    on random inputs in float32: a fork that edited those modules gets a one-line refusal, not another model."""
    g = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in (model_lib.RMSNorm, model_lib.LayerNorm):
                safe = Float16SafeNorm(child)
                x = torch.randn(3, 5, child.weight.shape[0], generator=g) * torch.tensor([1e-4, 1.0, 3e4])[:, None, None]
                check(child(x), safe(x), f"{type(child).__name__}.forward")
                setattr(parent, name, safe)
            elif type(child) is model_lib.Attention:
                q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (4, 9, 9))
                visible = model_lib.visible_slots(torch.tensor([[0, 3, 5, 8], [1, 2, 3, 4]]), 9)
                explicit = ExplicitAttention.of(child)
                check(child.attend(q, k, v, visible), explicit.attend(q, k, v, visible), "Attention.attend")
                setattr(parent, name, explicit)
            elif isinstance(child, (model_lib.RMSNorm, nn.LayerNorm, model_lib.Attention)):
                print(f"warning: {type(child).__name__} (a subclass) is exported as written; nothing checks it for "
                      "float16 overflow", file=sys.stderr)


def check(expected, got, what):
    error = ((got - expected).norm() / expected.norm()).item()
    if not error <= 1e-5:
        raise InputError(f"model.py's {what} differs from the export's float16-safe form (relative error {error:.1e}; "
                         "edited?); teach scripts/export_qaic.py the new math before exporting")


class RetainedStateKV(nn.Module):
    """Stands in for model.KVCache: the cache tensors are graph inputs, and the updated ones graph outputs."""

    def __init__(self):
        super().__init__()
        self.k_cache = self.v_cache = self.slots = self.is_padding = None  # set per call by QaicExport

    def update(self, slots, k, v):
        self.k_cache = self.scatter(self.k_cache, k)
        self.v_cache = self.scatter(self.v_cache, v)
        return self.k_cache, self.v_cache

    def scatter(self, cache, new):
        # cache [B, H, L, D], new [B, T, H, D]: one ScatterND at the (row, head, slot) index triples [B, H, T, 3];
        # padding columns write back what their slot holds
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

    def forward(self, input_ids, position_ids, *inputs):
        # the target's num_logits_to_keep [N, 1]: only its shape counts, N = 1 in prefill and K + 1 in decode
        keep, past = (inputs[0].shape[0], inputs[1:]) if self.role == "target" else (1, inputs)
        T, L = position_ids.shape[1], past[0].shape[2]
        is_padding = position_ids < 0
        # A row's valid positions are consecutive, p..p+n-1, and padding (-1) follows them, so slots p + j modulo L
        # are distinct: ScatterND's indices must not repeat.
        slots = (position_ids[:, :1] + torch.arange(T)) % L
        for i, cache in enumerate(self.caches):
            cache.k_cache, cache.v_cache, cache.slots, cache.is_padding = past[2 * i], past[2 * i + 1], slots, is_padding
        last = position_ids.to(torch.int32).argmax(1, keepdim=True)  # the last valid column
        logits_idx = (last + 1 - keep + torch.arange(keep)).clamp(min=0)
        logits = self.model(input_ids, position_ids.clamp(min=0), logits_idx)
        return (logits, *(t for cache in self.caches for t in (cache.k_cache, cache.v_cache)))


def io_names(n_layers: int, role: str):
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    keep = ["num_logits_to_keep"] if role == "target" else []
    return ["input_ids", "position_ids", *keep, *past], ["logits", *(f"{name}_RetainedState" for name in past)]


def core_split(text: str, role: str) -> int:
    """--num_cores: N cores for this graph, or TARGET/DRAFT, a split of one card between the pair -> this role's."""
    parts = text.split("/")
    if not (1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts)):
        raise InputError(f"--num_cores {text!r}: give the cores of this graph (1-{CARD_CORES}) or a TARGET/DRAFT split "
                         f"of one card such as 11/5")
    cores = [int(p) for p in parts]
    if min(cores) < 1 or sum(cores) > CARD_CORES:
        raise InputError(f"--num_cores {text}: a Cloud AI 100 has {CARD_CORES} cores; give each graph at least 1 and "
                         f"the pair at most {CARD_CORES} in all, such as 11/5")
    return cores[0] if len(cores) == 1 or role == "target" else cores[1]


def check_options(opts):
    if opts.speculate_k < 1:
        raise InputError(f"--speculate_k {opts.speculate_k}: must be at least 1")
    if opts.role == "target" and opts.speculate_k + 1 > opts.prefill_len:
        raise InputError(f"--speculate_k {opts.speculate_k} needs a decode of {opts.speculate_k + 1} positions, longer "
                         f"than --prefill_len {opts.prefill_len}; raise --prefill_len or lower --speculate_k")
    if opts.prefill_len < 1:
        raise InputError(f"--prefill_len {opts.prefill_len}: must be at least 1")
    if opts.ctx_len < opts.prefill_len:
        raise InputError(f"--ctx_len {opts.ctx_len} is shorter than one prefill chunk (--prefill_len "
                         f"{opts.prefill_len}); raise --ctx_len or lower --prefill_len")
    if opts.batch_size < 1:
        raise InputError(f"--batch_size {opts.batch_size}: must be at least 1")
    return core_split(opts.num_cores, opts.role)


def check_checkpoint(checkpoint_path, ctx_len: int) -> Path:
    """A float checkpoint whose context holds ctx_len, checked from its files alone. Returns its directory."""
    ckpt_dir, weights = resolve_checkpoint(checkpoint_path)
    args = read_model_args(ckpt_dir / "config.json")
    if map_safetensors(weights)[1].get("quantization"):
        raise InputError(f"{weights}: a quantize.py checkpoint; export the float model.safetensors (--mxfp6 "
                         "lets the compiler compress the weights)")
    if ctx_len > args.max_seq_len:
        raise InputError(f"--ctx_len {ctx_len} exceeds the model's context (config.json max_seq_len "
                         f"{args.max_seq_len})")
    return ckpt_dir


def load_float_model(checkpoint_path, ctx_len: int) -> Transformer:
    check_checkpoint(checkpoint_path, ctx_len)
    model = load_model(checkpoint_path, "cpu", torch.float32, backend="torch")  # the graph is model.py
    # rotary tables for every position the model has, so a compile for a longer ctx_len indexes inside them
    model.setup_rope(model.args.max_seq_len, "cpu")
    use_float16_safe_modules(model)
    return model


def export_onnx(model: Transformer, role: str, ctx_len: int, path: Path):
    # The TorchScript exporter: it writes opset 17 natively (the compiler takes 13..17), where the dynamo exporter
    # starts at 18 and its down-conversion fails (Split's num_outputs).
    args = model.args
    inputs, outputs = io_names(args.n_layers, role)
    axes = {"input_ids": {0: "batch_size", 1: "seq_len"}, "position_ids": {0: "batch_size", 1: "seq_len"},
            "num_logits_to_keep": {0: "num_logits_to_keep"},
            "logits": {0: "batch_size", 1: "num_logits_to_keep"} if role == "target" else {0: "batch_size"}}
    axes.update({name: {0: "batch_size", 2: "ctx_len"} for name in inputs if name.startswith("past_")})
    axes.update({name: {0: "batch_size", 2: "ctx_len"} for name in outputs[1:]})
    B, T, N = 2, 4, 3  # examples away from 1 and from each other, so no dimension is taken for a broadcast
    kv_shape = (B, args.n_kv_heads, ctx_len, args.head_dim)
    keep = [torch.zeros(N, 1, dtype=torch.long)] if role == "target" else []
    example = (torch.zeros(B, T, dtype=torch.long), torch.arange(T).repeat(B, 1), *keep,
               *(torch.zeros(kv_shape) for _ in range(2 * args.n_layers)))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(QaicExport(model, role), example, str(path), dynamo=False, input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=OPSET)


def finish_graph(exported: Path, path: Path, role: str, chunk_bytes: int = DATA_CHUNK_BYTES):
    """The exported graph, with the dynamic dimensions named as the specializations name them and float constants
    clipped to the float16 range, written to path with the weights beside it in files of at most chunk_bytes.
    -> (constants clipped, the graph's op types)"""
    import onnx
    from onnx import numpy_helper
    graph_model = onnx.load(str(exported))
    graph = graph_model.graph
    symbols = {"input_ids": ("batch_size", "seq_len"), "position_ids": ("batch_size", "seq_len"),
               "num_logits_to_keep": ("num_logits_to_keep", 1),
               "logits": ("batch_size", "num_logits_to_keep" if role == "target" else 1, None)}
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
    save_in_chunks(graph_model, path, chunk_bytes)
    onnx.checker.check_model(str(path))  # by path: the checker reads the external data too
    ops = sorted({node.op_type for node in graph.node} | {n.op_type for f in graph_model.functions for n in f.node})
    return clipped, ops


def save_in_chunks(graph_model, path: Path, chunk_bytes: int):
    """Every tensor over 1 KiB goes to model.onnx.data, then model.onnx.data.1, ... each at most chunk_bytes (or one
    tensor, if a tensor is larger)."""
    import onnx
    from onnx.external_data_helper import set_external_data
    files, size = [], chunk_bytes
    try:
        constants = [a.t for n in graph_model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
        for tensor in [*graph_model.graph.initializer, *constants]:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) <= 1024:
                continue
            if size + len(tensor.raw_data) > chunk_bytes and size:
                name = path.name + ".data" + (f".{len(files)}" if files else "")
                files.append(open(path.with_name(name), "wb"))
                size = 0
            set_external_data(tensor, name, offset=size, length=len(tensor.raw_data))
            files[-1].write(tensor.raw_data)
            size += len(tensor.raw_data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    finally:
        for f in files:
            f.close()
    onnx.save(graph_model, str(path))


def check_ops(ops: list[str]) -> list[str]:
    """-> the graph's op types that the repository's list of Cloud AI 100 ops does not hold."""
    known = set(json.loads(SUPPORTED_OPS.read_text())["ops"])
    return [op for op in ops if op not in known]


def side_files(out: Path, opts, args, num_cores: int, ops: list[str]):
    decode_len = opts.speculate_k + 1 if opts.role == "target" else 1
    entries = []
    for n, keep in ((opts.prefill_len, 1), (decode_len, decode_len)):  # prefill keeps the last position's logits
        entry = dict(batch_size=str(opts.batch_size), seq_len=str(n), ctx_len=str(opts.ctx_len))
        if opts.role == "target":
            entry["num_logits_to_keep"] = str(keep)
        if entry not in entries:
            entries.append(entry)
    (out / "specializations.json").write_text(json.dumps({"specializations": entries}, indent=1) + "\n")
    precision = "mxint8" if opts.mxint8_kv else "float16"
    _, outputs = io_names(args.n_layers, opts.role)
    kv = [name.removesuffix("_RetainedState") for name in outputs[1:]]
    lines = [f" - IOName: {name}\n   Precision: {precision}\n" for name in kv + outputs[1:]]
    (out / "custom_io.yaml").write_text("".join(lines))
    meta = dict(role=opts.role, batch_size=opts.batch_size, prefill_len=opts.prefill_len, decode_len=decode_len,
                ctx_len=opts.ctx_len, n_layers=args.n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                vocab_size=args.vocab_size, num_cores=num_cores, ops=ops)
    (out / "qaic.json").write_text(json.dumps(meta, indent=1) + "\n")


def compile_commands(out: Path, mxfp6: bool, num_cores: int) -> list[str]:
    """The compile command for current SDKs (qaic-compile) and the older qaic-exec form."""
    def command(tool, hw, *extra):
        return " ".join([f"/opt/qti-aic/exec/{tool}", f"-m={out / 'model.onnx'}", "-aic-hw", f"-aic-hw-version={hw}",
                         *extra, "-retained-state", "-convert-to-fp16", *(["-mxfp6-matmul"] if mxfp6 else []),
                         f"-aic-num-cores={num_cores}", f"-network-specialization-config={out / 'specializations.json'}",
                         f"-custom-IO-list-file={out / 'custom_io.yaml'}", f"-aic-binary-dir={out / 'qpc'}"])
    return [command("qaic-compile", "ai100"), command("qaic-exec", "2.0", "-compile-only")]


def export(opts, chunk_bytes: int = DATA_CHUNK_BYTES) -> Path:
    num_cores = check_options(opts)
    cli.require("onnx", "scripts/export_qaic.py")
    ckpt_dir = check_checkpoint(opts.checkpoint_path, opts.ctx_len)
    # an existing directory is replaced only if this tool wrote everything in it
    out = cli.check_output_dir(opts.output_dir, TOOL, inputs=[ckpt_dir], replaced_whole=True)
    model = load_float_model(opts.checkpoint_path, opts.ctx_len)
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside the destination and renamed into place: an interrupted export leaves no half directory
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        start = time.perf_counter()
        print(f"exporting {opts.role} ({model.args.n_layers} layers) to ONNX ...", file=sys.stderr)
        # torch writes a graph over protobuf's 2 GiB as one file per tensor beside it: kept apart, then dropped
        raw = work / "torch"
        raw.mkdir()
        export_onnx(model, opts.role, opts.ctx_len, raw / "model.onnx")
        clipped, ops = finish_graph(raw / "model.onnx", work / "model.onnx", opts.role, chunk_bytes)
        shutil.rmtree(raw)
        side_files(work, opts, model.args, num_cores, ops)
        for name in ("config.json", "tokenizer.json", "tokenizer.model"):
            if (ckpt_dir / name).is_file():
                shutil.copy(ckpt_dir / name, work / name)
        cli.write_mark(work, TOOL, [p.name for p in work.iterdir()])
        for path in [work, *work.iterdir()]:  # mkdtemp made it private
            path.chmod(0o755 if path.is_dir() else 0o644)
        old = work.with_name(work.name + ".old")
        if out.exists():  # a previous export, checked above: set aside, then removed once the new one is in place
            out.rename(old)
        work.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"exported in {time.perf_counter() - start:.0f} s; {clipped} float constants clipped to the float16 range",
          file=sys.stderr)
    print(f"ops ({len(ops)}): {' '.join(ops)}", file=sys.stderr)
    unknown = check_ops(ops)
    if unknown:
        print(f"warning: ops not in {SUPPORTED_OPS.name}'s list of Cloud AI 100 ops: {' '.join(unknown)}; check them "
              "against the SDK's own list (qaic-exec -operators-supported=onnx)", file=sys.stderr)
    print(f"# compile for {num_cores} cores, current SDKs, then older ones:", file=sys.stderr)
    for command in compile_commands(out, opts.mxfp6, num_cores):
        print(command)
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
    p.add_argument("--num_cores", default="11/5", help="cores for this graph, or a TARGET/DRAFT split of one 16-core "
                   "card (default 11/5: the target takes 11, the draft 5)")
    return p


def main(argv=None):
    cli.run(export, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
