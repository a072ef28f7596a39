"""Build and load the C++ extension in csrc/ (just in time, cached), or say why the fallback is used.

    ext = builder.load()      # the compiled module, or None (then every op uses its torch fallback)
    builder.status()          # what happened, for `python -m engine.report`

The first use compiles csrc/cpu/*.cpp with torch.utils.cpp_extension and ninja into a per-user cache,
`$ZERO_ENGINE_CACHE` or ~/.cache/zero_engine/ops/<name>-<key>-<install>, where the key hashes the
sources (their paths too: ninja's build file names them by absolute path, so two checkouts of the same
code, e.g. git worktrees, sharing one folder rebuilt each other's build on every start, and their ranks
timed out waiting) and the flags, and <install> the torch installation (its directory and version,
Python's version and ABI tag, the compiler's version): two virtualenvs get two builds instead of
rebuilding each other's.
Later processes load the cached library; concurrent ranks wait on one builder (engine/ops/build_lock.py,
which says whom it waits for and takes over the lock of a builder that died). `python -m engine.ops.build`
builds ahead of time (at install).

`ZERO_ENGINE_OPS`: unset/`auto` builds when it can and falls back with one warning when it cannot;
`fallback` never builds (tests of the torch paths); `require` makes a failed build an error (CI, to
make sure the compiled path is the one tested).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from engine.ops import build_lock

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
NAME = "zero_engine_cpu_ops"
CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-fno-math-errno"]  # as torch builds: lets sqrtf vectorise
ENV_MODE = "ZERO_ENGINE_OPS"


@dataclass
class BuildStatus:
    mode: str = "auto"
    state: str = "not loaded"
    """"compiled" (built now), "cached" (loaded from the cache), "fallback" (forced or failed)."""
    reason: str = ""
    cache_dir: str = ""
    compiler: str = ""
    seconds: float = 0.0
    simd: str = "unknown"
    sources: list[str] = field(default_factory=list)


_lock = threading.Lock()
_module: ModuleType | None = None
_status = BuildStatus()
_tried = False


def mode() -> str:
    value = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if value not in ("auto", "fallback", "require"):
        raise ValueError(f"{ENV_MODE}={value!r}: use auto (default), fallback or require")
    return value


def sources() -> list[Path]:
    return sorted((CSRC / "cpu").glob("*.cpp"))


def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return ""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else ""


def cache_key(files: list[Path], compiler: str) -> str:
    """The sources' and flags' part of the build directory's name (installation_key() is the rest). The
    sources' absolute paths count: see the module docstring."""
    digest = hashlib.sha256()
    for path in files + sorted((CSRC / "cpu").glob("*.h")):
        digest.update(str(path.resolve()).encode())
        digest.update(path.read_bytes())
    for part in (torch.__version__, compiler, " ".join(CPU_FLAGS), sys.version.split()[0]):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def installation_key(compiler: str, torch_dir: str | None = None, torch_version: str | None = None,
                     python: str | None = None, abi: str | None = None) -> str:
    """A short hash of the torch installation a build is made for: torch's directory (two venvs with the
    same torch version compile against different headers and libraries, and ninja would rebuild one's
    build for the other on every start), torch's version, Python's version and ABI tag, the compiler.
    The arguments default to this process's installation."""
    parts = (torch_dir if torch_dir is not None else os.path.dirname(os.path.abspath(torch.__file__)),
             torch_version if torch_version is not None else torch.__version__,
             python if python is not None else sys.version,
             abi if abi is not None else str(sysconfig.get_config_var("SOABI")),
             compiler)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def build_dir(name: str, key: str, compiler: str) -> Path:
    """Where an extension with these sources (key) is built for this torch installation."""
    return cache_root() / f"{name}-{key}-{installation_key(compiler)}"


def cache_root() -> Path:
    base = os.environ.get("ZERO_ENGINE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zero_engine")
    return Path(base) / "ops"


def find_ninja() -> bool:
    """ninja on PATH, or the one pip installed beside this Python (a venv's bin/ is often not on PATH
    when it is used as .venv/bin/python); torch.utils.cpp_extension looks it up on PATH."""
    if shutil.which("ninja") is not None:
        return True
    beside = Path(sys.executable).parent
    if (beside / "ninja").exists():
        os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False


def _why_not_buildable(files: list[Path], compiler: str) -> str:
    if not files:
        return f"no C++ sources under {CSRC / 'cpu'} (an installed copy without csrc/; use an editable install)"
    if not compiler:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH); install g++ or set CXX"
    if not find_ninja():
        return "ninja is not on PATH; pip install ninja (or apt install ninja-build)"
    return ""


def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None when the fallback is in use."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _module = _load()
        _tried = True
    return _module


def _load() -> ModuleType | None:
    _status.mode = mode()
    if _status.mode == "fallback":
        _status.state, _status.reason = "fallback", f"forced by {ENV_MODE}=fallback"
        return None
    files = sources()
    _status.sources = [str(f.relative_to(ROOT)) for f in files]
    compiler = compiler_version()
    _status.compiler = compiler
    problem = _why_not_buildable(files, compiler)
    if problem:
        _fail(problem)
        return None
    directory = build_dir(NAME, cache_key(files, compiler), compiler)
    _status.cache_dir = str(directory)
    started = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        with locked_build(directory, NAME, "the C++ extension", len(files), "about 30-120 s") as cached:
            module = cpp_extension.load(name=NAME, sources=[str(f) for f in files], extra_cflags=CPU_FLAGS,
                                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 (a compiler error must not take training down: the fallback is exact)
        _fail(f"the build failed: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}")
        return None
    _status.seconds = time.perf_counter() - started
    _status.state = "cached" if cached else "compiled"
    _status.simd = module.simd_level()
    if not cached:
        _say(f"compiled the C++ extension in {_status.seconds:.1f} s ({_status.simd})")
    return module


ANNOUNCE_CACHED_WAIT_S = 5.0  # a holder that has a cached build is only loading it: say nothing unless it takes long


@contextmanager
def locked_build(directory: Path, name: str, what: str, n_sources: int, expected: str) -> Iterator[bool]:
    """Holds the build directory's lock (one builder per directory; the others wait, one message each)
    and yields whether the library was already built; says on stderr, on the process that builds, that
    it compiles, where, and how long that usually takes."""
    def cached() -> bool:
        return any(directory.glob(f"{name}*.so"))

    with build_lock.held(directory, what, announce_after_s=ANNOUNCE_CACHED_WAIT_S if cached() else 0.0):
        built = cached()
        if not built:
            where = f"rank {os.environ['RANK']}, " if "RANK" in os.environ else ""
            _say(f"compiling {what} ({n_sources} sources, first use for this torch installation; {expected}; "
                 f"{where}pid {os.getpid()} on {socket.gethostname()}; cached in {directory}) ...")
        yield built


def _say(message: str) -> None:
    print(f"[engine] {message}", file=sys.stderr, flush=True)


def record_failure(status: BuildStatus, reason: str, extension: str, on: str = "") -> None:
    """An extension cannot be used: an error under ZERO_ENGINE_OPS=require, else one warning (the
    fallbacks give the same results). Shared by the CPU and the CUDA loaders."""
    status.state, status.reason = "fallback", reason
    if status.mode == "require":
        raise RuntimeError(f"{ENV_MODE}=require but the {extension} is unavailable: {reason}")
    warnings.warn(f"engine: {extension} unavailable ({reason}); using the pure-torch fallbacks{on} (same results, "
                  "slower)", RuntimeWarning, stacklevel=4)


def _fail(reason: str) -> None:
    record_failure(_status, reason, "C++ extension")


def status() -> BuildStatus:
    load()
    return _status


def reset_for_tests() -> None:
    """Forget the loaded module so the next load() reads ZERO_ENGINE_OPS again."""
    global _module, _tried
    with _lock:
        _module, _tried = None, False
