"""Greedy generation for a list of cases, under torchrun (tensor parallel) or in one process (the reference).

    torchrun --standalone --nproc_per_node=N tests/tp_worker.py CASES.json RESULTS.json

Each case: checkpoint, optional draft (replicated, as generate.py does), prompts (token lists, one batch),
max_new_tokens, speculate_k, compile, dtype and draft_dtype (torch dtype names, default float32). Rank 0 writes one result per case: the tokens of each row, and the
weight bytes each rank held.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ranks  # noqa: E402
from backend import report  # noqa: E402
from decoding import Steps, generate  # noqa: E402
from loading import load_model  # noqa: E402
from speculative import ModelDrafter  # noqa: E402


def run_cases(cases, group=None):
    results = []
    for case in cases:
        dtype, draft_dtype = (getattr(torch, case.get(key, "float32")) for key in ("dtype", "draft_dtype"))
        model = load_model(case["checkpoint"], "cpu", dtype, tp_group=group)
        drafter = None
        if case.get("draft"):
            drafter = ModelDrafter(load_model(case["draft"], "cpu", draft_dtype), compile=case.get("compile", False))
        rows, stats = generate(model, case["prompts"], case["max_new_tokens"], Steps(compile=case.get("compile", False)),
                               temperature=0.0, drafter=drafter, speculate_k=case.get("speculate_k", 3))
        held = [report(model).held_bytes]
        if group is not None:
            held = [None] * dist.get_world_size(group)
            dist.all_gather_object(held, report(model).held_bytes, group=group)
        results.append(dict(tokens=rows, weight_bytes=held, mean_accepted=stats.get("mean_accepted")))
    return results


if __name__ == "__main__":
    group, _ = ranks.init_from_env("cpu")
    results = run_cases(json.loads(Path(sys.argv[1]).read_text()), group)
    if ranks.is_rank0():
        part = Path(sys.argv[2] + ".tmp")
        part.write_text(json.dumps(results))
        os.replace(part, sys.argv[2])
    ranks.finish()
