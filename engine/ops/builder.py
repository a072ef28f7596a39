"""Build and load the CPU ops library in csrc/cpu (just in time, cached), or say why the fallback is used.

    ops = builder.load()      # the compiled ops (engine/ops/cpu_lib.CpuOps), or None (every op uses its torch fallback)
    builder.status()          # what happened, for `python -m engine.report`

The first use compiles csrc/cpu/*.cpp with the system C++ compiler (`$CXX`, else c++), one process per
source in parallel, into a plain shared library that engine/ops/cpu_lib.py loads with ctypes: no
pybind11, no torch/extension.h, no ninja (see [Note: a plain C++ library behind a ctypes binding] in
csrc/cpu/ops.h). A clean build took 3 s on 2 cores here, where the pybind11 extension took 80 s. The
library goes into a per-user cache, `$ZERO_ENGINE_CACHE` or ~/.cache/zero_engine/ops/<name>-<key>-<install>,
where the key hashes the sources (their paths too: two checkouts of the same code, e.g. git worktrees,
sharing one folder rebuilt each other's build on every start, and their ranks timed out waiting) and
the flags, and <install> the torch installation (its directory and version, Python's version and ABI
tag, the compiler's version): two virtualenvs get two builds instead of rebuilding each other's.
Later processes load the cached library; concurrent ranks wait on one builder (engine/ops/build_lock.py,
which says whom it waits for and takes over the lock of a builder that died). `python -m engine.ops.build`
builds ahead of time (at install). engine/ops/cuda_builder.py loads the CUDA extension through the same
locked_load() and OnceLoader.

`ZERO_ENGINE_OPS`: unset/`auto` builds when it can and falls back with one warning when it cannot;
`fallback` never builds (tests of the torch paths); `require` makes a failed build an error (CI, to
make sure the compiled path is the one tested).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from engine.ops import build_lock

if TYPE_CHECKING:
    from engine.ops.cpu_lib import CpuOps

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
NAME = "zero_engine_cpu_ops"
CPU_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=c++17",
    "-fno-math-errno",
]  # as torch builds: lets sqrtf vectorise
ENV_MODE = "ZERO_ENGINE_OPS"
COMPILE_TIMEOUT_S = 900
T = TypeVar("T")


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


class OnceLoader(Generic[T]):
    """Runs a loader at most once per process, whichever threads ask (the first runs it, the others wait
    and share its result), until reset(); a loader that raises is run again by the next caller."""

    def __init__(self, load: Callable[[], T | None]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._done = False
        self._value: T | None = None

    def get(self) -> T | None:
        if self._done:
            return self._value
        with self._lock:
            if not self._done:
                self._value = self._load()
                self._done = True
        return self._value

    def reset(self) -> None:
        with self._lock:
            self._value, self._done = None, False


_status = BuildStatus()


def mode() -> str:
    value = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if value not in ("auto", "fallback", "require"):
        raise ValueError(f"{ENV_MODE}={value!r}: use auto (default), fallback or require")
    return value


def sources() -> list[Path]:
    return sorted((CSRC / "cpu").glob("*.cpp"))


def find_compiler() -> str | None:
    """The C++ compiler: $CXX, else c++, on PATH (or a path); None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def compiler_version() -> str:
    path = find_compiler()
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


def installation_key(
    compiler: str,
    torch_dir: str | None = None,
    torch_version: str | None = None,
    python: str | None = None,
    abi: str | None = None,
) -> str:
    """A short hash of the torch installation a build is made for: torch's directory (two venvs with the
    same torch version compile against different headers and libraries, and ninja would rebuild one's
    build for the other on every start), torch's version, Python's version and ABI tag, the compiler.
    The arguments default to this process's installation."""
    parts = (
        torch_dir if torch_dir is not None else os.path.dirname(os.path.abspath(torch.__file__)),
        torch_version if torch_version is not None else torch.__version__,
        python if python is not None else sys.version,
        abi if abi is not None else str(sysconfig.get_config_var("SOABI")),
        compiler,
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def build_dir(name: str, key: str, compiler: str) -> Path:
    """Where an extension with these sources (key) is built for this torch installation."""
    return cache_root() / f"{name}-{key}-{installation_key(compiler)}"


def cache_root() -> Path:
    base = os.environ.get("ZERO_ENGINE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zero_engine")
    return Path(base) / "ops"


def find_ninja() -> bool:
    """ninja on PATH, or the one pip installed beside this Python (a venv's bin/ is often not on PATH
    when it is used as .venv/bin/python); torch.utils.cpp_extension, which builds the CUDA extension,
    looks it up on PATH. The CPU library needs no ninja."""
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
    return ""


_loader: OnceLoader[CpuOps] = OnceLoader(lambda: _load())


def load() -> CpuOps | None:
    """The compiled CPU ops, building the library on first use; None when the fallback is in use."""
    return _loader.get()


def _load() -> CpuOps | None:
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

    def build() -> CpuOps:
        from engine.ops.cpu_lib import CpuOps

        library = directory / f"{NAME}.so"
        if not library.exists():
            compile_library(files, library)
        ops = CpuOps(library)
        _status.simd = ops.simd_level()
        return ops

    return locked_load(
        _status,
        directory,
        NAME,
        "the C++ extension",
        len(files),
        "about 5-15 s",
        build,
        _fail,
        note=lambda ops: f" ({ops.simd_level()})",
    )


def torch_include() -> str:
    """torch's header directory: the kernels use c10's header-only bfloat16/float16 types from it."""
    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "include")


def compile_library(files: list[Path], library: Path) -> None:
    """Compiles each source to an object (all at once, one compiler process each) and links them into
    `library`, which appears under its name only when complete; RuntimeError with the compiler's error
    lines when a step fails."""
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH)")
    objects = [library.with_name(f"{src.stem}.o") for src in files]
    flags = [*CPU_FLAGS, "-fPIC", "-isystem", torch_include()]
    ok, log = run_all([[cxx, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(files, objects)])
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    if ok:
        ok, log = run_all([[cxx, "-shared", *map(str, objects), "-fopenmp", "-o", str(partial)]])
    if not ok:
        raise RuntimeError(f"compiling {library.name} failed:\n{log}")
    os.replace(partial, library)
    for obj in objects:  # only the library is loaded; a changed source gets a new directory anyway
        obj.unlink(missing_ok=True)


def run_all(commands: list[list[str]]) -> tuple[bool, str]:
    """Runs the commands in parallel; (all exited 0, their command lines and output)."""
    running = [
        (command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for command in commands
    ]
    ok, log = True, ""
    for command, process in running:
        try:
            output, _ = process.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0] + f"\ntimed out after {COMPILE_TIMEOUT_S} s\n"
        ok = ok and process.returncode == 0
        log += f"$ {shlex.join(command)}\n{output}"
        if process.returncode != 0:
            log += f"exit status {process.returncode}\n"
    return ok, log


def locked_load(
    status: BuildStatus,
    directory: Path,
    name: str,
    what: str,
    n_sources: int,
    expected: str,
    build: Callable[[], T],
    fail: Callable[[str], None],
    note: Callable[[T], str] = lambda _: "",
) -> T | None:
    """The build-or-load of both extensions: `build` (compile if needed, then load) runs under the build
    directory's lock (one builder per directory, the others wait; see locked_build), the status records
    the seconds and whether it compiled or found the cache, and stderr says when it compiled (with
    `note` of the result). A failure is not raised: fail() gets the reason (a warning, or an error under
    ZERO_ENGINE_OPS=require) and the result is None, the fallbacks being exact."""
    started = time.perf_counter()
    try:
        with locked_build(directory, name, what, n_sources, expected) as cached:
            result = build()
    except Exception as error:  # noqa: BLE001 (a compiler error must not take training down: the fallback is exact)
        fail(f"the build failed: {error_summary(error)}")
        return None
    status.seconds = time.perf_counter() - started
    status.state = "cached" if cached else "compiled"
    if not cached:
        build_lock.say(f"compiled {what} in {status.seconds:.1f} s{note(result)}")
    return result


def error_summary(error: Exception) -> str:
    """The compiler's error lines ("<file>:<line>:<col>: error: ...", nvcc's "<file>(<line>): error: ...")
    when there are any, else the message's last line (torch's own ends in a generic one)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower() and not line.startswith("$ ")]
    return "; ".join(errors[:3]) if errors else (lines[-1] if lines else repr(error))


ANNOUNCE_CACHED_WAIT_S = 5.0  # a holder that has a cached build is only loading it: say nothing unless it takes long


@contextmanager
def locked_build(directory: Path, name: str, what: str, n_sources: int, expected: str) -> Iterator[bool]:
    """Holds the build directory's lock (one builder per directory; the others wait, one message each)
    and yields whether the library was already built; says on stderr, on the process that builds, that
    it compiles, where, and how long that usually takes."""

    def cached() -> bool:
        return any(directory.glob(f"{name}*.so"))  # the final name only: a partial build is NAME.so.<pid>.tmp

    with build_lock.held(directory, what, announce_after_s=ANNOUNCE_CACHED_WAIT_S if cached() else 0.0):
        built = cached()
        if not built:
            where = f"rank {os.environ['RANK']}, " if "RANK" in os.environ else ""
            build_lock.say(
                f"compiling {what} ({n_sources} sources, first use for this torch installation; {expected}; "
                f"{where}pid {os.getpid()} on {socket.gethostname()}; cached in {directory}) ..."
            )
        yield built


def record_failure(status: BuildStatus, reason: str, extension: str, on: str = "") -> None:
    """An extension cannot be used: an error under ZERO_ENGINE_OPS=require, else one warning (the
    fallbacks give the same results). Shared by the CPU and the CUDA loaders."""
    status.state, status.reason = "fallback", reason
    if status.mode == "require":
        raise RuntimeError(f"{ENV_MODE}=require but the {extension} is unavailable: {reason}")
    warnings.warn(
        f"engine: {extension} unavailable ({reason}); using the pure-torch fallbacks{on} (same results, slower)",
        RuntimeWarning,
        stacklevel=4,
    )


def _fail(reason: str) -> None:
    record_failure(_status, reason, "C++ extension")


def status() -> BuildStatus:
    load()
    return _status


def reset_for_tests() -> None:
    """Forget the loaded library so the next load() reads ZERO_ENGINE_OPS again."""
    _loader.reset()
