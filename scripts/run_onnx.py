"""Run an exported target + draft pair (scripts/export_qaic.py) under onnxruntime: greedy speculative decoding
with the host loop the Cloud AI 100's host runs.

    python scripts/run_onnx.py --target qaic/target --draft qaic/draft --prompt "def fib(n):" --max_new_tokens 64

Only the shapes of the specializations are used: prefill calls of prefill_len tokens (the last chunk padded
with position -1), draft decodes of 1 token, target decodes of K + 1. Each call's *_RetainedState outputs
are the next call's past inputs. A round: the draft catches up on the tokens it has not seen and proposes K
tokens one at a time; the target scores [last, d1..dK] at positions p..p+K in one call; the longest prefix
of drafts equal to the target's argmax is accepted, plus the target's next token. The next call starts at
p + accepted + 1 and overwrites the stale slots.
"""
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import InputError, OneLineErrors  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


class ExportedModel:
    """One exported graph, its KV state, and how many leading positions of that state are valid."""

    def __init__(self, directory, role: str):
        import onnxruntime
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
        self.directory = directory
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(str(directory / "model.onnx"), options,
                                                    providers=["CPUExecutionProvider"])
        m = self.meta
        shape = (1, m["n_kv_heads"], m["ctx_len"], m["head_dim"])
        self.past = {f"past_{kind}.{i}": np.zeros(shape, np.float32) for i in range(m["n_layers"])
                     for kind in ("key", "value")}
        self.valid = 0  # positions 0..valid-1 of the state hold the sequence's tokens

    def __call__(self, tokens: list[int], start: int) -> np.ndarray:
        """Tokens at positions start.. (padded to the call's length with position -1) -> logits [n, V] from the
        target, [1, V] from the draft (its graph returns the last valid position only)."""
        n = len(tokens)
        length = self.meta["decode_len"] if n <= self.meta["decode_len"] else self.meta["prefill_len"]
        ids = np.zeros((1, length), np.int64)
        ids[0, :n] = tokens
        positions = np.full((1, length), -1, np.int64)
        positions[0, :n] = np.arange(start, start + n)
        logits, *state = self.session.run(None, dict(input_ids=ids, position_ids=positions, **self.past))
        self.past = dict(zip(self.past, state))
        self.valid = start + n
        return logits[0, :n]

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


def speculative_greedy(target: ExportedModel, draft: ExportedModel, prompt: list[int], max_new_tokens: int):
    """-> (new tokens, histogram of tokens accepted per round)"""
    check_pair(target, draft, len(prompt), max_new_tokens)
    k = target.meta["decode_len"] - 1
    tokens = prompt + [int(target.prefill(prompt).argmax())]
    draft.prefill(prompt)
    accepted = Counter()
    while len(tokens) - len(prompt) < max_new_tokens:
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
    return tokens[len(prompt):len(prompt) + max_new_tokens], accepted


def main(argv=None):
    p = OneLineErrors(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="directory written by export_qaic.py --role target")
    p.add_argument("--draft", required=True, help="directory written by export_qaic.py --role draft")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="one JSON line: tokens, text and the acceptance metrics")
    opts = p.parse_args(argv)
    try:
        target, draft = ExportedModel(opts.target, "target"), ExportedModel(opts.draft, "draft")
        tokenizer = Tokenizer(opts.target)
        prompt = tokenizer.encode(opts.prompt)
        start = time.perf_counter()
        new, accepted = speculative_greedy(target, draft, prompt, opts.max_new_tokens)
        seconds = time.perf_counter() - start
    except InputError as e:
        sys.exit(f"error: {e}")
    rounds = sum(accepted.values())  # as generate.py: accept_counts[n] rounds accepted n drafts; each adds one more
    metrics = dict(accept_counts=[accepted[n] for n in range(target.meta["decode_len"])],
                   mean_accepted=(sum(n * c for n, c in accepted.items()) + rounds) / rounds, speculate_k=target.meta["decode_len"] - 1,
                   tokens_per_s=len(new) / seconds)
    if opts.json:
        print(json.dumps(dict(prompt=opts.prompt, tokens=new, text=tokenizer.decode(new), **metrics)))
    else:
        print(opts.prompt + tokenizer.decode(new), flush=True)
        print(f"{metrics['tokens_per_s']:.1f} tok/s under onnxruntime, {metrics['mean_accepted']:.2f} tokens per round "
              f"(K={metrics['speculate_k']}), accept counts {metrics['accept_counts']}", file=sys.stderr)


if __name__ == "__main__":
    main()
