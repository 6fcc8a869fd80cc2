"""few_rows.cpp: built for this CPU at first use, cached under a name made from what made it, and its ops."""
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("few_rows.cpp")  # one translation unit of the headers in few_rows/
loaded = None  # whether the ops are loaded; None: not tried yet
built = None  # the name of the build loaded (build_name)


def cpu_features() -> str:
    """What -march=native compiles for: this CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()


def source_text() -> str:
    """few_rows.cpp and its headers, as one text (what a build is made of)."""
    return "\0".join(path.read_text() for path in [SOURCE, *sorted(SOURCE.with_suffix("").glob("*.h"))])


def build_name(source: str, march: str, portable: bool = False) -> str:
    """The build's name, a hash of what made it (sources, flags, the torch install and Python it links against, CPU
    features): a build from other sources or for another interpreter is never loaded."""
    made_of = "\0".join([source, march, "portable" if portable else "", torch.__version__,
                         str(Path(torch.__file__).resolve()), sys.version, cpu_features() if march == "native" else ""])
    return "few_rows_" + hashlib.sha256(made_of.encode()).hexdigest()[:16]


def cpp_extension():
    """torch.utils.cpp_extension, imported without the warning a CUDA build of torch logs there when it finds nvcc
    but no GPU ("No CUDA runtime is found"; PyPI's torch on a CPU machine): these kernels build for the CPU."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as extension
    finally:
        log.setLevel(level)
    return extension


def build_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension().get_default_build_root())


LOCK_WAIT_S = float(os.environ.get("FEW_ROWS_LOCK_WAIT_S", 900))  # then build beside the holder, not wait forever


def build(march: str = "native", portable: bool = False):
    """Load few_rows.cpp's ops built for `march`, building them first if no process has (the library is kept as
    BUILD_ROOT/NAME.so, ~/.cache/torch_extensions by default). A build runs in a directory of its own and renames
    its library into place, so checkouts and interpreters never rebuild each other's, a reader never loads half a
    library, and a killed build leaves nothing that blocks the next (its lock is an flock, released at exit).
    portable: without intrinsics (-DFEW_ROWS_PORTABLE), the plain code that the tests compare bit for bit."""
    global built
    name = build_name(source_text(), march, portable)
    built = name
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    library = root / f"{name}.so"
    if not library.is_file():
        with build_lock(root / f"{name}.lock"):
            if not library.is_file():
                return compile_and_load(name, march, library, portable)
    torch.ops.load_library(str(library))


@contextlib.contextmanager
def build_lock(path: Path):
    """One build of a library at a time; waits (saying for whom) at most LOCK_WAIT_S."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builds are still atomic, only not deduplicated
        yield
        return
    with open(path, "a+") as f:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    print(f"waiting for {holder}'s build of few_rows.cpp (lock {path}; at most {LOCK_WAIT_S:.0f} s)",
                          file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() - start > LOCK_WAIT_S:
                    print(f"few_rows.cpp: {path} still locked after {LOCK_WAIT_S:.0f} s; building separately",
                          file=sys.stderr, flush=True)
                    yield
                    return
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_and_load(name: str, march: str, library: Path, portable: bool = False):
    """Build in a directory of this process's, load, and rename the library into place; says so on stderr."""
    load = cpp_extension().load
    root = library.parent
    for stale in root.glob(f"{name}.build-*"):  # left by a killed build (the lock is ours: no live build uses it)
        pid = stale.name.split("-")[-2] if stale.name.count("-") >= 2 else ""
        if not (pid.isdigit() and alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.build-{os.getpid()}-", dir=root))
    print(f"building few_rows.cpp for this CPU (-march={march}{', portable' if portable else ''}; once per source, "
          "flags, torch and CPU)...", end="",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        load(name=name, sources=[str(SOURCE)], build_directory=str(work), is_python_module=False,
             extra_cflags=["-O3", f"-march={march}", "-fopenmp"] + (["-DFEW_ROWS_PORTABLE"] if portable else []),
             extra_ldflags=["-fopenmp"])
        os.replace(work / f"{name}.so", library)
    except BaseException:
        print(" failed", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f" done in {time.perf_counter() - start:.0f} s: {library}", file=sys.stderr)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load() -> bool:
    """The ops built for this CPU, once per process (or the build this process already loaded: one build a process);
    False (with one warning) where they do not build (no C++ compiler): the model then runs on PyTorch's kernels."""
    global loaded
    if loaded is not None:
        return loaded
    try:
        if built is None:
            build()
    except Exception as error:  # no compiler, no ninja, unknown flags: run without, and say so once
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
        print(f"warning: few_rows.cpp did not build ({reason[:200]}); the CPU backend is off, the model runs on "
              "PyTorch's kernels", file=sys.stderr)
        loaded = False
        return False
    # Shapes for torch.compile, which traces without running the kernels.
    torch.library.register_fake("few_rows::linear")(
        lambda x, layout, weight, factors, table, bias, outputs: x.new_empty(*x.shape[:-1], outputs))
    torch.library.register_fake("few_rows::rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
    torch.library.register_fake("few_rows::attention")(lambda q, k, v, positions, scale: q.new_empty(q.shape))
    loaded = True
    return True
