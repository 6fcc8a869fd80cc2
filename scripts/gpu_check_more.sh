#!/usr/bin/env bash
# What scripts/gpu_check.sh leaves for a second call of under 10 minutes: tests/test_cuda.py, then the 7B-shaped rows
# each in its own call: int4k, int8 and mxfp6 plain, the K = 7 verify (bf16 drafted by itself: the verify's cost), the
# bf16 target drafted by its int4 copy (K = 7) on the Triton rows kernels, and int4 on aten (--backend aten: tinygemm).
# Into $OUT/gpu_check_more.log where $OUT is set.
# Usage: bash scripts/gpu_check_more.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-${OUT:-.}/gpu_check_more.log}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench="$py scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2"
{
    timeout 225 $py tests/test_cuda.py
    for row in quant-int4k quant-int8 quant-mxfp6 spec-self-7 spec-int4-7; do
        timeout 110 $bench --rows $row
    done
    timeout 110 $bench --backend aten --rows quant-int4
} 2>&1 | tee "$log"
