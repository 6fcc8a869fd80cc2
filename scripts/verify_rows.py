"""The CUDA backend's rows check on every product shape of a config and every mode: the longest verify (tokens a
row, up to 17) each computes as a decode step does, bit for bit, and where the first difference is. One layer of
random weights is enough: every layer has the same shapes. Then (--compiled) the whole step compiled, on two layers:
a verify of 8 tokens against 8 decode steps, each compiled as decoding.py compiles it, logits bit for bit (what lies
between the kernels is Inductor's code, compiled separately for each row count). A part of scripts/gpu_check.sh.

    python scripts/verify_rows.py scripts/configs/llama-2-7b.json [--device cpu] [--backend torch] [--compiled bf16,int4]
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
import quantize  # noqa: E402
from bench import random_model  # noqa: E402
from speculative import compile_step, forward  # noqa: E402
from checkpoint import OneLineErrors, read_model_args  # noqa: E402
from loading import check_device  # noqa: E402


def check(opts):
    one_layer = dataclasses.asdict(read_model_args(opts.config)) | {"n_layers": 1}
    check_device(opts.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(one_layer))
        for mode in (None, "int8", "int4", "int4k", "mxfp6", "mxfp4"):
            start = time.perf_counter()
            model = random_model(path, opts.device, torch.bfloat16, mode, opts.backend)
            rows, where = gpu.exact_verify_tokens(model)
            print(f"{mode or 'bf16'}: verify rows computed as a decode step computes them: 1 to {rows}"
                  f"{'; ' + where if where else ''} ({time.perf_counter() - start:.1f} s)", flush=True)
            del model
        if opts.compiled:
            path.write_text(json.dumps(one_layer | {"n_layers": 2}))
            for mode in opts.compiled.split(","):
                compiled_check(path, opts, None if mode == "bf16" else mode)


def compiled_check(config, opts, mode, prompt=40, tokens=8):
    """A verify of `tokens` after a prompt against as many decode steps, both compiled, logits bit for bit."""
    start = time.perf_counter()
    model = random_model(config, opts.device, torch.bfloat16, mode, opts.backend)
    model.setup_caches(1, 256)
    step = compile_step(forward, opts.device)
    g = torch.Generator(opts.device).manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (1, prompt + tokens), generator=g, device=opts.device)
    positions = torch.arange(prompt + tokens, device=opts.device)[None]
    with torch.no_grad():
        model(ids[:, :prompt], positions[:, :prompt])
        verify = step(model, ids[:, prompt:], positions[:, prompt:])
        decode = torch.cat([step(model, ids[:, i:i + 1], positions[:, i:i + 1]) for i in range(prompt, prompt + tokens)],
                           1)
    same = [torch.equal(verify[:, i], decode[:, i]) for i in range(tokens)]
    verdict = "bit for bit" if all(same) else f"differ first at row {same.index(False) + 1}"
    print(f"{mode or 'bf16'}, compiled, 2 layers: a verify of {tokens} tokens and {tokens} decode steps: {verdict} "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    del model
    torch._dynamo.reset()


def main(argv=None):
    parser = OneLineErrors(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config.json (scripts/configs/ has the 7B's shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch"))
    parser.add_argument("--compiled", default="", help="modes whose compiled step to check on two layers "
                        "(e.g. bf16,int4); none by default")
    opts = parser.parse_args(argv)
    modes = ["bf16", *quantize.FORMATS]
    unknown = [mode for mode in opts.compiled.split(",") if opts.compiled and mode not in modes]
    if unknown:
        parser.error(f"--compiled: unknown mode '{unknown[0]}' (one of {', '.join(modes)})")
    cli.run(check, opts)


if __name__ == "__main__":
    main()
