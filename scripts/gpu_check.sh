#!/usr/bin/env bash
# The GPU check, self-contained (no network, nothing beyond torch and this checkout), into one log, most important
# first: the rows check on the 7B's product shapes in every mode (the longest verify each computes as a decode step
# does), tests/test_cuda.py, then the 7B-shaped bench rows the H100 run of 2026-11-26 left unmeasured (int8, a
# verify of K = 7) beside bf16. Each part has its own time limit (a 7B row compiles in 75-90 s there), so the whole fits one
# 10-minute call and a cut part still returns the parts before it. Usage: bash scripts/gpu_check.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-gpu_check.log}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU image has python3, maybe no python
bench="$py scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    timeout 60 $py scripts/verify_rows.py scripts/configs/llama-2-7b.json
    timeout 220 $py tests/test_cuda.py
    timeout 280 $bench --rows compiled,quant-int8,spec-self-7
} 2>&1 | tee "$log"
