"""The CUDA backend's rows check on every product shape of a config and every mode: the longest verify (tokens a
row, up to 17) each computes as a decode step does, bit for bit, and where the first difference is. One layer of
random weights is enough: every layer has the same shapes. The first part of scripts/gpu_check.sh.

    python scripts/verify_rows.py scripts/configs/llama-2-7b.json [--device cpu] [--backend torch]
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import dataclasses  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import gpu  # noqa: E402
from bench import random_model  # noqa: E402
from checkpoint import OneLineErrors, read_model_args  # noqa: E402
from loading import check_device  # noqa: E402


def check(opts):
    one_layer = dataclasses.asdict(read_model_args(opts.config)) | {"n_layers": 1}
    check_device(opts.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(one_layer))
        for mode in (None, "int8", "int4", "mxfp6", "mxfp4"):
            start = time.perf_counter()
            model = random_model(path, opts.device, torch.bfloat16, mode, opts.backend)
            rows, where = gpu.exact_verify_tokens(model)
            print(f"{mode or 'bf16'}: verify rows computed as a decode step computes them: 1 to {rows}"
                  f"{'; ' + where if where else ''} ({time.perf_counter() - start:.1f} s)", flush=True)
            del model


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config.json (scripts/configs/ has the 7B's shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch"))
    opts = parser.parse_args(argv)
    cli.run(check, opts)


if __name__ == "__main__":
    main()
