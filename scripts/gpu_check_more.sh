#!/usr/bin/env bash
# What scripts/gpu_check.sh leaves for a second call of under 10 minutes: the 7B-shaped rows int8 and mxfp6 plain and
# the bf16 target drafted by its int4 copy (K = 7) on the Triton rows kernels, then bf16, int4 and the K = 7 verify
# on aten (--backend aten: cuBLAS, tinygemm, SDPA), side by side in the log.
# Usage: bash scripts/gpu_check_more.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-gpu_check_more.log}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench="$py scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2"
{
    timeout 280 $bench --rows quant-int8,quant-mxfp6,spec-int4-7
    timeout 280 $bench --backend aten --rows compiled,quant-int4,spec-self-7
} 2>&1 | tee "$log"
