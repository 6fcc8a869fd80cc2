#!/usr/bin/env bash
# The GPU check, self-contained (no network, nothing beyond torch and this checkout), into one log: the 7B-shaped bench
# rows against bf16 (the speed goals), tests/test_cuda.py, then a verify of K = 7 and mxfp6 in a second bench.
# Each part has its own time limit, so a lease that ends early still returns the parts before it.
# Usage: bash scripts/gpu_check.sh [LOG] (default gpu_check.log)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-gpu_check.log}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/gpu-check-inductor}  # the second bench reuses the first's compiles
py=${PYTHON:-python3}  # the GPU image has python3, maybe no python
bench="$py scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    timeout 240 $bench --rows compiled,quant-int8,quant-int4
    timeout 150 $py tests/test_cuda.py
    timeout 180 $bench --rows compiled,spec-self-7,quant-mxfp6
} 2>&1 | tee "$log"
