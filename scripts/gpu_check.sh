#!/usr/bin/env bash
# The GPU check, self-contained (no network, nothing beyond torch, Triton and this checkout), most important first,
# a line as each part finishes, into one log ($OUT/gpu_check.log where a remote run collects $OUT): every format's
# products at the 7B's shapes (1, 8 and 17 rows, beside torch.mm and tinygemm; ~30 s), the rows check of every mode
# and the step compiled on two 7B-sized layers (a verify's logits against decode steps', bit for bit), then the
# 7B-shaped bench rows, each in its own call: bf16 compiled, int4. Each part has its own time limit (a 7B row
# compiles in 75-90 s on an H100), so the whole fits one call of under 9 minutes and a cut part still returns the
# parts before it. tests/test_cuda.py and the other rows: gpu_check_more.sh. Every part runs here at toy shapes
# (tests/test_bench.py; the Triton kernels under TRITON_INTERPRET=1).
# Usage: bash scripts/gpu_check.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-${OUT:-.}/gpu_check.log}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU image has python3, maybe no python
config=scripts/configs/llama-2-7b.json
bench="$py scripts/bench.py --device cuda --random_weights $config --num_prompts 2 --runs 2"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    timeout 100 $py scripts/bench_products.py $config
    timeout 150 $py scripts/verify_rows.py $config --compiled bf16,int4
    timeout 130 $bench --rows compiled
    timeout 130 $bench --rows quant-int4
} 2>&1 | tee "$log"
