"""Run an exported target + draft pair (scripts/export_qaic.py): greedy speculative decoding with the host loop the
Cloud AI 100's host runs, on onnxruntime, on a float16 emulation of the card, or on the card itself.

    python scripts/run_onnx.py --target qaic/target --draft qaic/draft --prompt "def fib(n):" --max_new_tokens 64
        [--runtime onnxruntime | float16 | qaic]

Runtimes: `onnxruntime` runs the fp32 graph; `float16` runs it as the card's -convert-to-fp16 does, every float
tensor and every op in float16, with onnx's ReferenceEvaluator (slow: a check, not a server); `qaic` runs the
compiled programs (`<dir>/qpc`, written by the compile commands export_qaic.py prints) through the SDK's `qaicrt`,
with the KV state kept on the card (-retained-state) and never sent or read.

Only the shapes of the specializations are used: prefill calls of prefill_len tokens (the last chunk padded
with position -1), draft decodes of 1 token, target decodes of K + 1. A round: the draft catches up on the tokens
it has not seen and proposes K tokens one at a time; the target scores [last, d1..dK] at positions p..p+K in one
call; the longest prefix of drafts equal to the target's argmax is accepted, plus the target's next token. The
next call starts at p + accepted + 1 and overwrites the stale slots.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402

from checkpoint import InputError, OneLineErrors  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


class HostState:
    """A runtime that takes the KV state as inputs and returns it as outputs: the host keeps it between calls."""

    dtype = np.float32

    def __init__(self, directory: Path, meta: dict):
        self.meta = meta
        shape = (meta["batch_size"], meta["n_kv_heads"], meta["ctx_len"], meta["head_dim"])
        self.past = {f"past_{kind}.{i}": np.zeros(shape, self.dtype) for i in range(meta["n_layers"])
                     for kind in ("key", "value")}

    def run(self, feeds: dict) -> np.ndarray:
        logits, *state = self.evaluate({**feeds, **self.past})
        self.past = dict(zip(self.past, state))
        return logits.astype(np.float32)


class OnnxRuntime(HostState):
    def __init__(self, directory: Path, meta: dict):
        import onnxruntime
        super().__init__(directory, meta)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(str(directory / "model.onnx"), options,
                                                    providers=["CPUExecutionProvider"])

    def evaluate(self, feeds):
        return self.session.run(None, feeds)


class Float16(HostState):
    """The graph with every float tensor, constant and Cast in float16, run op by op by onnx's ReferenceEvaluator,
    which rounds each op's result to float16 (onnxruntime's CPU provider computes some float16 ops in float32 and
    would hide an overflow). Products accumulate in float32 and round their result to float16."""

    dtype = np.float16

    def __init__(self, directory: Path, meta: dict):
        from onnx.reference import ReferenceEvaluator
        super().__init__(directory, meta)
        self.evaluator = ReferenceEvaluator(float16_graph(directory / "model.onnx"), new_ops=[float32_sum_matmul()])

    def evaluate(self, feeds):
        with np.errstate(all="ignore"):  # softmax's masked -65504 and the unused branch of sigmoid overflow by design
            return self.evaluator.run(None, feeds)


def float16_graph(path: Path):
    """The ONNX model at path, converted as -convert-to-fp16 converts it: float32 becomes float16 everywhere."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def tensor(t):
        # External data is read with numpy, not into the message: protobuf keeps whatever a message ever held
        # until the whole model is freed, and a 1.5B model's float32 bytes beside its float16 ones outgrew 24 GB.
        if t.data_location == TensorProto.EXTERNAL:
            where = {e.key: e.value for e in t.external_data}
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            array = np.fromfile(path.parent / where["location"], dtype, int(where["length"]) // dtype.itemsize,
                                offset=int(where.get("offset", 0))).reshape(tuple(t.dims))
        elif t.data_type == TensorProto.FLOAT:
            array = numpy_helper.to_array(t)
        else:
            return
        t.CopyFrom(numpy_helper.from_array(array.astype(np.float16) if array.dtype == np.float32 else array, t.name))

    def nodes(node_list):
        for node in node_list:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensor(attr.t)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    graph(attr.g)
                elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16

    def graph(g):
        for t in g.initializer:
            tensor(t)
        for value in [*g.input, *g.output, *g.value_info]:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = TensorProto.FLOAT16
        nodes(g.node)

    model = onnx.load(str(path), load_external_data=False)
    graph(model.graph)
    for function in model.functions:
        nodes(function.node)
    return model


WIDENED_BYTES = 3 << 30


def float32_sum_matmul():
    """A MatMul for one graph's evaluator (each graph gets its own WIDENED_BYTES of float32 copies)."""
    from onnx.reference.op_run import OpRun

    class MatMul(OpRun):
        """float16 MatMul as a float32 BLAS product rounded to float16 (numpy's own float16 product is slow). A
        float16 -> float32 cast is exact; a node keeps the float32 copy of its constant weight while the copies
        total under WIDENED_BYTES (a 1.5B model's would not fit beside it in 24 GB: the rest widen per call)."""
        widened = (None, None)
        room = [WIDENED_BYTES]  # shared by this graph's nodes

        def _run(self, a, b):
            if a.dtype != np.float16:
                return (np.matmul(a, b),)
            if self.widened[0] is b:
                wide = self.widened[1]
            else:
                wide = b.astype(np.float32)
                if self.widened[0] is None and wide.nbytes <= self.room[0]:
                    self.widened, self.room[0] = (b, wide), self.room[0] - wide.nbytes
            return (np.matmul(a.astype(np.float32), wide).astype(np.float16),)

    return MatMul


class Qaic:
    """The compiled program on the card through the SDK's qaicrt: the KV buffers stay on the card (-retained-state),
    so every past_* input and *_RetainedState output is skipped; the logits buffer is sized per specialization."""

    def __init__(self, directory: Path, meta: dict, device_id: int = 0):
        qaicrt, aicapi = import_qaic_runtime()
        qpc_path = directory / "qpc"
        if not qpc_path.is_dir():
            raise InputError(f"{qpc_path}: no compiled program; run the compile command export_qaic.py printed")
        self.qaicrt, self.meta = qaicrt, meta
        self.context = qaicrt.Context()
        self.queue = qaicrt.Queue(self.context, device_id)
        qpc = qaicrt.Qpc(str(qpc_path))
        status, descriptor = qpc.getIoDescriptor()
        self.ok(status, "read the program's IO descriptor")
        io = aicapi.IoDesc()
        io.ParseFromString(bytes(descriptor))
        self.bindings = list(io.selected_set.bindings)
        self.index = {b.name: b.index for b in self.bindings}
        self.np_type = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16,
                        aicapi.INT64_I_TYPE: np.int64, aicapi.INT32_I_TYPE: np.int32}
        self.program = qaicrt.Program(self.context, device_id, qpc, qaicrt.QAicProgramProperties())
        self.ok(self.program.load(), "load the program")
        self.program.activate()
        self.exec = qaicrt.ExecObj(self.context, self.program)
        self.buffers = [qaicrt.QBuffer(bytes(0)) for _ in self.bindings]  # empty: skipped
        self.dims = qaicrt.BufferDimensionsVecRef([(np.dtype(self.np_type[b.type]).itemsize, [0])
                                                   for b in self.bindings])

    def ok(self, status, what):
        if status != self.qaicrt.QStatus.QS_SUCCESS:
            raise RuntimeError(f"qaicrt could not {what} ({status})")

    def put(self, name, array):
        i = self.index[name]
        self.buffers[i] = self.qaicrt.QBuffer(array.tobytes())
        self.dims[i] = (array.itemsize, list(array.shape))

    def run(self, feeds: dict) -> np.ndarray:
        for name, array in feeds.items():
            self.put(name, array)
        keep = feeds["num_logits_to_keep"].shape[0] if "num_logits_to_keep" in feeds else 1
        logits_type = self.np_type[self.bindings[self.index["logits"]].type]
        self.put("logits", np.zeros((self.meta["batch_size"], keep, self.meta["vocab_size"]), logits_type))
        self.ok(self.exec.setData(self.buffers, self.dims), "set the buffers")
        self.ok(self.queue.enqueue(self.exec), "enqueue a run")
        self.ok(self.exec.waitForCompletion(), "run the program")
        status, outputs = self.exec.getData()
        self.ok(status, "read the outputs")
        logits = np.frombuffer(bytes(outputs[self.index["logits"]]), logits_type)
        return logits.reshape(self.meta["batch_size"], keep, -1).astype(np.float32)


def import_qaic_runtime():
    """-> (qaicrt, QAicApi_pb2) from the Cloud AI 100 Platform and Apps SDKs, where they install them."""
    sys.path += [f"/opt/qti-aic/dev/lib/{platform.machine()}", "/opt/qti-aic/dev/python"]
    try:
        import QAicApi_pb2
        import qaicrt
    except ImportError as e:
        raise InputError(f"the Cloud AI 100 runtime is not installed ({e.name} not found in /opt/qti-aic/dev); run on "
                         "a host with the card's Platform and Apps SDKs, or use --runtime onnxruntime") from None
    return qaicrt, QAicApi_pb2


RUNTIMES = {"onnxruntime": OnnxRuntime, "float16": Float16, "qaic": Qaic}


class ExportedModel:
    """One exported graph on a runtime, and how many leading positions of its KV state are valid."""

    def __init__(self, directory, role: str, runtime: str = "onnxruntime"):
        directory = Path(directory)
        meta_path = directory / "qaic.json"
        if not meta_path.is_file():
            raise InputError(f"{meta_path}: not found; export with scripts/export_qaic.py --role {role}")
        self.meta = json.loads(meta_path.read_text())
        if self.meta["role"] != role:
            raise InputError(f"{meta_path}: role is '{self.meta['role']}', expected '{role}'; export with "
                             f"--role {role}")
        if self.meta["batch_size"] != 1:
            raise InputError(f"{meta_path}: batch_size {self.meta['batch_size']}; this loop drives one sequence, "
                             "export with --batch_size 1")
        if "num_cores" not in self.meta:
            raise InputError(f"{meta_path}: written by an older export_qaic.py; export again")
        self.directory, self.role, self.runtime_name, self.started = directory, role, runtime, None
        self.valid = 0  # positions 0..valid-1 of the state hold the sequence's tokens

    @property
    def runtime(self):
        """The graph on its runtime, started at first use (after every check: it takes seconds to minutes)."""
        if self.started is None:
            self.started = RUNTIMES[self.runtime_name](self.directory, self.meta)
        return self.started

    def __call__(self, tokens: list[int], start: int) -> np.ndarray:
        """Tokens at positions start.. (padded to the call's length with position -1) -> logits [n, V] of the last
        n positions: every position in the target's decode, the last one in a prefill and in every draft call."""
        n, m = len(tokens), self.meta
        decode = n <= m["decode_len"]
        length = m["decode_len"] if decode else m["prefill_len"]
        ids = np.zeros((1, length), np.int64)
        ids[0, :n] = tokens
        positions = np.full((1, length), -1, np.int64)
        positions[0, :n] = np.arange(start, start + n)
        feeds = dict(input_ids=ids, position_ids=positions)
        keep = m["decode_len"] if decode and self.role == "target" else 1
        if self.role == "target":
            feeds["num_logits_to_keep"] = np.zeros((keep, 1), np.int64)
        logits = self.runtime.run(feeds)
        self.valid = start + n
        return logits[0, keep - min(n, keep):]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        chunk = self.meta["prefill_len"]
        for start in range(0, len(tokens), chunk):
            logits = self(tokens[start:start + chunk], start)
        return logits[-1]


def check_pair(target: ExportedModel, draft: ExportedModel, prompt_len: int, max_new_tokens: int):
    t, d = target.meta, draft.meta
    if t["vocab_size"] != d["vocab_size"] or not Tokenizer(target.directory).same_vocabulary(Tokenizer(draft.directory)):
        raise InputError(f"{draft.directory}: the draft's vocabulary differs from the target's ({target.directory}); "
                         "speculation needs the same tokenizer")
    k = t["decode_len"] - 1
    need = prompt_len + max_new_tokens + k - 1  # the last round verifies K + 1 positions past the last token
    for model in (target, draft):
        if model.meta["ctx_len"] < need:
            raise InputError(f"{model.directory / 'qaic.json'}: ctx_len {model.meta['ctx_len']} is smaller than prompt "
                             f"({prompt_len}) + max_new_tokens ({max_new_tokens}) + speculate_k ({k}) - 1 = {need}; "
                             f"re-export with --ctx_len {need} or more")


def until_end(new: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """The new tokens up to max_new_tokens, ending at the first end-of-generation token (kept), as generate.py ends."""
    new = new[:max_new_tokens]
    return next((new[:i + 1] for i, t in enumerate(new) if t in eos_ids), new)


def greedy(target: ExportedModel, prompt: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Plain greedy decoding on the target alone, one token per decode call: the reference for speculative_greedy."""
    tokens = prompt + [int(target.prefill(prompt).argmax())]
    while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] not in eos_ids:
        tokens.append(int(target([tokens[-1]], len(tokens) - 1)[-1].argmax()))
    return until_end(tokens[len(prompt):], max_new_tokens, eos_ids)


def speculative_greedy(target: ExportedModel, draft: ExportedModel, prompt: list[int], max_new_tokens: int,
                       eos_ids=()):
    """-> (new tokens, histogram of tokens accepted per round)"""
    check_pair(target, draft, len(prompt), max_new_tokens)
    k = target.meta["decode_len"] - 1
    tokens = prompt + [int(target.prefill(prompt).argmax())]
    draft.prefill(prompt)
    accepted = Counter()
    while len(tokens) - len(prompt) < max_new_tokens and not any(t in eos_ids for t in tokens[len(prompt):]):
        for token in tokens[draft.valid:]:  # the 1 or 2 tokens the draft has not seen
            logits = draft([token], draft.valid)
        proposals = [int(logits[-1].argmax())]
        while len(proposals) < k:
            proposals.append(int(draft([proposals[-1]], draft.valid)[-1].argmax()))
        best = target([tokens[-1], *proposals], len(tokens) - 1).argmax(-1)
        n = 0
        while n < k and proposals[n] == best[n]:
            n += 1
        tokens += proposals[:n] + [int(best[n])]
        accepted[n] += 1
        target.valid = len(tokens) - 1  # the state beyond holds rejected drafts: overwritten next round
        draft.valid = min(draft.valid, len(tokens) - 1)
    return until_end(tokens[len(prompt):], max_new_tokens, eos_ids), accepted


def main(argv=None):
    p = OneLineErrors(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="directory written by export_qaic.py --role target")
    p.add_argument("--draft", required=True, help="directory written by export_qaic.py --role draft")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--runtime", choices=list(RUNTIMES), default="onnxruntime",
                   help="onnxruntime (fp32), float16 (the card's precision, emulated op by op; slow) or qaic (the card)")
    p.add_argument("--json", action="store_true", help="one JSON line: tokens, text and the acceptance metrics")
    cli.run(run, p.parse_args(argv))


def run(opts):
    if opts.max_new_tokens < 1:
        raise InputError(f"--max_new_tokens {opts.max_new_tokens}: must be at least 1")
    cli.require("onnx", "scripts/run_onnx.py")
    if opts.runtime == "onnxruntime":
        cli.require("onnxruntime", "scripts/run_onnx.py --runtime onnxruntime")
    target = ExportedModel(opts.target, "target", opts.runtime)
    draft = ExportedModel(opts.draft, "draft", opts.runtime)
    tokenizer = Tokenizer(opts.target)
    prompt = tokenizer.encode(opts.prompt)
    if not prompt:
        raise InputError("empty prompt: give at least one token")
    check_pair(target, draft, len(prompt), opts.max_new_tokens)  # before the runtimes start
    start = time.perf_counter()
    new, accepted = speculative_greedy(target, draft, prompt, opts.max_new_tokens, tokenizer.eos_ids)
    seconds = time.perf_counter() - start
    rounds = sum(accepted.values())  # as generate.py: accept_counts[n] rounds accepted n drafts; each adds one more
    metrics = dict(accept_counts=[accepted[n] for n in range(target.meta["decode_len"])],
                   mean_accepted=(sum(n * c for n, c in accepted.items()) + rounds) / rounds,
                   speculate_k=target.meta["decode_len"] - 1, tokens_per_s=len(new) / seconds)
    text = tokenizer.decode([t for t in new if t not in tokenizer.eos_ids])
    if opts.json:
        print(json.dumps(dict(prompt=opts.prompt, tokens=new, text=text, **metrics)))
    else:
        print(opts.prompt + text, flush=True)
        print(f"{metrics['tokens_per_s']:.1f} tok/s on {opts.runtime}, {metrics['mean_accepted']:.2f} tokens per round "
              f"(K={metrics['speculate_k']}), accept counts {metrics['accept_counts']}", file=sys.stderr)


if __name__ == "__main__":
    main()
