"""The CUDA backend's rows check on every product shape of a config and every mode: the longest verify (tokens a
row, up to 17) each computes as a decode step does, bit for bit, and where the first difference is. One layer of
random weights is enough: every layer has the same shapes. The first part of scripts/gpu_check.sh.

    python scripts/verify_rows.py scripts/configs/llama-2-7b.json [DEVICE (default cuda)] [BACKEND (default auto)]
"""
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import torch  # noqa: E402

import gpu  # noqa: E402
from bench import random_model  # noqa: E402


def main(config, device="cuda", backend="auto"):
    one_layer = dict(json.loads(Path(config).read_text()), n_layers=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(one_layer))
        for mode in (None, "int8", "int4", "mxfp6", "mxfp4"):
            start = time.perf_counter()
            model = random_model(path, device, torch.bfloat16, mode, backend)
            rows, where = gpu.exact_verify_tokens(model)
            print(f"{mode or 'bf16'}: verify rows computed as a decode step computes them: 1 to {rows}"
                  f"{'; ' + where if where else ''} ({time.perf_counter() - start:.1f} s)", flush=True)
            del model


if __name__ == "__main__":
    main(*sys.argv[1:])
