"""Convert a Hugging Face model directory or a .gguf file into this project's checkpoint layout.

    python scripts/convert_checkpoint.py --source SRC --output_dir OUT

OUT receives config.json (ModelArgs fields plus tokenizer ids), model.safetensors and the tokenizer
(tokenizer.json or tokenizer.model). Every file is written to a temporary name and renamed, the config last,
so a directory with a config.json is always complete. What each source gives: hf_import.py (a Hugging Face
directory), gguf_import.py (a .gguf file); hf_export.py goes back to `transformers`.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402

from checkpoint import (InputError, OneLineErrors, check_model_args, write_atomically,  # noqa: E402
                        write_safetensors)
from gguf_import import read_gguf  # noqa: E402
from hf_import import read_hf  # noqa: E402

TOOL = "scripts/convert_checkpoint.py"


def save_checkpoint(output_dir: Path, args: dict, weights: dict, special: dict, tokenizers, chat=None, dtype=None):
    """weights: name -> a tensor, or (shape, produce) for a tensor made as it is written (GGUF's dequantized float32
    ones), so that the converter holds one tensor at a time. Floating tensors are stored in dtype where given.
    chat: the chat template and its BOS and EOS strings, kept as tokenizer_config.json (chat.py reads it)."""
    check_model_args(args, output_dir / "config.json")  # before writing anything
    output_dir.mkdir(parents=True, exist_ok=True)
    names = ["config.json", "model.safetensors"] + [t.name if isinstance(t, Path) else "tokenizer.json"
                                                    for t in tokenizers] + (["tokenizer_config.json"] if chat else [])
    cli.write_mark(output_dir, TOOL, names)  # first: a later run may replace these files, and only these
    config_path = output_dir / "config.json"
    config_path.unlink(missing_ok=True)  # a directory without config.json reads as incomplete until we finish
    entries = {}
    for name, w in weights.items():
        shape, produce, kind = (w.shape, lambda w=w: w, w.dtype) if isinstance(w, torch.Tensor) else (*w, torch.float32)
        entries[name] = (shape, dtype if dtype and kind.is_floating_point else kind, produce)
    write_safetensors(output_dir / "model.safetensors", entries, {"format": "pt"}, progress="writing")
    for tok in tokenizers:
        if isinstance(tok, Path):
            write_atomically(output_dir / tok.name, lambda p: shutil.copyfile(tok, p))
        else:
            write_atomically(output_dir / "tokenizer.json", lambda p: tok.save(str(p)))
    if chat:
        write_atomically(output_dir / "tokenizer_config.json",
                         lambda p: p.write_text(json.dumps(chat, indent=2, ensure_ascii=False) + "\n"))
    config = dict(args, **{k: v for k, v in special.items() if v is not None})
    write_atomically(config_path, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def convert(source, output_dir, dtype=None):
    source, output_dir = Path(source), Path(output_dir)
    if not source.exists():
        raise InputError(f"{source}: not found")
    cli.check_output_dir(output_dir, TOOL, inputs=[source])
    if source.suffix == ".gguf":
        args, weights, special, tokenizers, chat = read_gguf(source)
    elif source.is_dir():
        args, weights, special, tokenizers, chat = read_hf(source)
    else:
        raise InputError(f"{source}: expected a Hugging Face model directory or a .gguf file")
    if not tokenizers:
        raise InputError(f"{source}: no tokenizer.json or tokenizer.model found")
    save_checkpoint(output_dir, args, weights, special, tokenizers, chat, dtype)
    return output_dir


def main(argv=None):
    parser = OneLineErrors(description=__doc__)
    parser.add_argument("--source", required=True, help="Hugging Face model directory or .gguf file")
    parser.add_argument("--output_dir", required=True, help="a new or empty directory, or one this tool wrote")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="storage dtype (auto: as the source; dequantized GGUF is float32)")
    opts = parser.parse_args(argv)
    # every file is written under a temporary name, and config.json last
    out = cli.run(convert, opts.source, opts.output_dir, None if opts.dtype == "auto" else getattr(torch, opts.dtype),
                  on_interrupt="interrupted; no file was left half-written")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
