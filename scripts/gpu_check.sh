#!/usr/bin/env bash
# The GPU check, self-contained (no network, nothing beyond torch, Triton and this checkout), into one log, most
# important first: the rows check on the 7B's product shapes in every mode (the longest verify each computes as a
# decode step does, on the Triton rows kernels gpu.py serves), tests/test_cuda.py, then the 7B-shaped bench rows:
# bf16 and int4 plain and a K = 7 verify (bf16 drafted by itself: the verify's cost). Each part has its own time
# limit (a 7B row compiled in 75-90 s on an H100), so the whole fits one call of under 9 minutes and a cut part still
# returns the parts before it. What does not fit (int8, mxfp6, the int4 draft, aten beside): gpu_check_more.sh.
# Usage: bash scripts/gpu_check.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-gpu_check.log}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU image has python3, maybe no python
bench="$py scripts/bench.py --device cuda --random_weights scripts/configs/llama-2-7b.json --num_prompts 2 --runs 2"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    timeout 60 $py scripts/verify_rows.py scripts/configs/llama-2-7b.json
    timeout 225 $py tests/test_cuda.py
    timeout 255 $bench --rows compiled,quant-int4,spec-self-7
} 2>&1 | tee "$log"
