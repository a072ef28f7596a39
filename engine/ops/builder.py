"""Build and load the C++ extension in csrc/ (just in time, cached), or say why the fallback is used.

    ext = builder.load()      # the compiled module, or None (then every op uses its torch fallback)
    builder.status()          # what happened, for `python -m engine.report`

The first use compiles csrc/cpu/*.cpp with torch.utils.cpp_extension and ninja into a per-user cache,
`$ZERO_ENGINE_CACHE` or ~/.cache/zero_engine/ops/<name>-<key>, where the key hashes the sources,
the torch version, the compiler's version and the flags; later processes load the cached library
(concurrent ranks wait on torch's build lock instead of compiling twice). `python -m engine.ops.build`
builds ahead of time (at install).

`ZERO_ENGINE_OPS`: unset/`auto` builds when it can and falls back with one warning when it cannot;
`fallback` never builds (tests of the torch paths); `require` makes a failed build an error (CI, to
make sure the compiled path is the one tested).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

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
    digest = hashlib.sha256()
    for path in files + sorted((CSRC / "cpu").glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for part in (torch.__version__, compiler, " ".join(CPU_FLAGS), sys.version.split()[0]):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


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
        return _fail(problem)
    build_dir = cache_root() / f"{NAME}-{cache_key(files, compiler)}"
    _status.cache_dir = str(build_dir)
    cached = any(build_dir.glob(f"{NAME}*.so"))
    _clear_stale_lock(build_dir)
    started = time.perf_counter()
    if not cached:
        print(f"[engine] compiling the C++ extension ({len(files)} sources, first use; cached in {build_dir}) ...",
              file=sys.stderr, flush=True)
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=NAME, sources=[str(f) for f in files], extra_cflags=CPU_FLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as error:  # noqa: BLE001 (a compiler error must not take training down: the fallback is exact)
        return _fail(f"the build failed: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}")
    _status.seconds = time.perf_counter() - started
    _status.state = "cached" if cached else "compiled"
    _status.simd = module.simd_level()
    if not cached:
        print(f"[engine] compiled the C++ extension in {_status.seconds:.1f} s ({_status.simd})", file=sys.stderr,
              flush=True)
    return module


STALE_LOCK_SECONDS = 900


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build lock waits forever for a lock file whose builder died (killed mid-compile): a lock
    older than any real build here (~2 min) is removed, with a warning, instead of hanging every rank."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"engine: removing a stale build lock {lock} ({age / 60:.0f} min old; its build died)",
                      RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


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
