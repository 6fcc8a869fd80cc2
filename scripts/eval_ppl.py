"""Perplexity of a checkpoint (full-precision or quantized) on HumanEval prompt + canonical solution text.

    python scripts/eval_ppl.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.mxfp6.safetensors

Each task is one sequence (BOS + prompt + solution); every token after the first is scored. Perplexity is
exp(total negative log-likelihood / total scored tokens), over all tasks together. Weights are loaded in
--dtype (bf16: the baseline the quantized modes are compared with) and activations are computed in float32, so
the numbers differ only by the weights (and a float32 prefill is ~3x faster than bf16 on CPUs without bf16 FMA).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from checkpoint import InputError, OneLineErrors, resolve_checkpoint  # noqa: E402
from loading import DTYPES, load_model  # noqa: E402
from cli import humaneval_tasks  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


@torch.no_grad()
def perplexity(model, tokenizer, texts, progress=True) -> tuple[float, int]:
    nll, count = 0.0, 0
    for text in tqdm(texts, desc="perplexity", disable=not progress, unit="task"):
        ids = tokenizer.encode(text)[: model.args.max_seq_len]
        model.setup_caches(1, len(ids))
        tokens = torch.tensor([ids])
        logits = model(tokens, torch.arange(len(ids))[None]).float()
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count), count


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_path", required=True)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--num_tasks", type=int, default=164, help="the first N HumanEval tasks (MX files run "
                        "model.py's reference forward, which decodes every weight per call: ~1 minute a task for "
                        "SmolLM2 on 2 cores)")
    parser.add_argument("--json", action="store_true")
    cli.run(evaluate, parser.parse_args(argv))


def evaluate(args):
    if not 1 <= args.num_tasks <= 164:
        raise InputError(f"--num_tasks {args.num_tasks}: HumanEval has 164 tasks; give 1 to 164")
    ckpt_dir, weights = resolve_checkpoint(args.checkpoint_path)
    tokenizer = Tokenizer(ckpt_dir)
    # the dtype's weights, float32 arithmetic on model.py alone (the backend serves a model in its own dtype)
    model = load_model(args.checkpoint_path, "cpu", DTYPES[args.dtype], backend="torch").float()
    texts = [t["prompt"] + t["canonical_solution"] for t in humaneval_tasks(args.num_tasks)]
    ppl, count = perplexity(model, tokenizer, texts, progress=not args.json)
    result = dict(checkpoint=str(weights), dtype=args.dtype, tasks=len(texts), tokens=count, perplexity=round(ppl, 4))
    print(json.dumps(result) if args.json else f"{weights.name}: perplexity {ppl:.4f} over {count} tokens")


if __name__ == "__main__":
    main()
