#!/usr/bin/env bash
# The GPU check, self-contained (no network, nothing beyond torch and this checkout): tests/test_cuda.py, then the
# 7B-shaped bench rows on random weights, into one log. Usage: bash scripts/gpu_check.sh [LOG] (default gpu_check.log)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-gpu_check.log}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    python tests/test_cuda.py
    python scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2 \
        --rows compiled,quant-int8,quant-int4,quant-mxfp6,spec-self-1,spec-self-3,spec-self-7
} 2>&1 | tee "$log"
