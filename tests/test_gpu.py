"""The CUDA backend without a GPU: its Triton kernels in Triton's interpreter (tests/gpu_kernels_checks.py, in a
process of its own with TRITON_INTERPRET=1). tests/test_cuda.py is the check on a GPU."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_triton_kernels_in_triton_s_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (requirements-dev.txt): the CUDA kernels' "
                                         "interpreter checks skip")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/gpu_kernels_checks.py"], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
