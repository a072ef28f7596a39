"""Build and load the CUDA extension in csrc/cuda/, and check that its sources compile without a GPU.

    ext = cuda_builder.load()               # the compiled module, or None (status().reason says why)
    cuda_builder.status()                   # what happened, for reports
    ok, log = cuda_builder.compile_check()  # nvcc compile-only for sm_80 and sm_90; no GPU needed

load() builds only when torch.cuda.is_available(): csrc/cuda/*.cu with nvcc and *.cpp with the host
compiler, through torch.utils.cpp_extension and ninja, into the per-user cache of the CPU extension
(engine/ops/builder.py), under a key that hashes the sources, torch and its CUDA version, nvcc's and the
host compiler's versions, the flags and the target architectures, plus the torch installation's key
(builder.installation_key), behind the same one-builder lock (engine/ops/build_lock.py) and through the
same build-or-load sequence (builder.locked_load) and once-per-process loader (builder.OnceLoader).
`ZERO_ENGINE_OPS` means what it means for the CPU extension: `fallback` never builds, `require` makes a
failed build an error. No usable CUDA is not a failure in any mode (there is nothing for CUDA ops to run
on, and a CPU-only CI running with `require` requires the CPU extension): load() returns None and
status().reason says why.

compile_check() guards the CUDA sources where no GPU is (CI, this kind of machine, a CPU build of
torch): nvcc -c of every .cu for sm_80 and sm_90 with the flags torch uses for CUDA extensions, and the
host compiler's -fsyntax-only of every .cpp (the bindings). A success is remembered in the cache under a
key of the sources, nvcc, the host compiler, torch and the flags, so unchanged sources are not compiled
again on every test run; a failure is never remembered.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from engine.ops import builder
from engine.ops.builder import ENV_MODE, BuildStatus

CUDA_DIR = builder.CSRC / "cuda"
NAME = "zero_engine_cuda_ops"
CUDA_FLAGS = ["-O3", "-std=c++17"]  # torch adds its common nvcc flags and a -gencode per visible GPU
HOST_FLAGS = ["-O3", "-std=c++17"]
CHECK_ARCHS = ("80", "90")  # A100; H100 and H200

_status = BuildStatus()


def sources(directory: Path = CUDA_DIR) -> list[Path]:
    """The translation units: every .cu (nvcc) and .cpp (host compiler) of the CUDA extension."""
    return sorted(directory.glob("*.cu")) + sorted(directory.glob("*.cpp"))


def find_nvcc() -> str | None:
    """nvcc on PATH, else bin/nvcc under $CUDA_HOME or $CUDA_PATH; None when there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        candidate = os.path.join(home, "bin", "nvcc") if home else ""
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_version(nvcc: str) -> str:
    """`nvcc --version`'s release line (e.g. "Cuda compilation tools, release 13.0, V13.0.88"), or ""."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    lines = [line.strip() for line in out.stdout.splitlines() if "release" in line]
    return lines[-1] if out.returncode == 0 and lines else ""


def _digest(directory: Path, parts: list[str]) -> str:
    digest = hashlib.sha256()
    files = sources(directory) + sorted(directory.glob("*.cuh")) + sorted(directory.glob("*.h"))
    for path in files:
        digest.update(str(path.resolve()).encode())  # a checkout's own build: see engine/ops/builder.py
        digest.update(path.read_bytes())
    for part in parts:
        digest.update(part.encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- compile check (no GPU needed)


def _torch_includes() -> list[str]:
    from torch.utils import cpp_extension

    try:
        return cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.6 spells it cuda=True
        try:
            return cpp_extension.include_paths(cuda=True)  # type: ignore[call-arg]
        except OSError:
            pass
    except OSError:  # a CPU build of torch has no CUDA_HOME; nvcc adds its own include directory anyway
        pass
    return cpp_extension.include_paths()


def _common_flags() -> list[str]:
    includes = _torch_includes()
    flags = ["-std=c++17", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={NAME}"]
    # A CPU build of torch ships c10/cuda without the generated cuda_cmake_macros.h (all it defines is
    # C10_CUDA_BUILD_SHARED_LIBS, which matters on Windows only); this define skips the include.
    c10_cuda = Path(includes[0]) / "c10" / "cuda"
    if c10_cuda.is_dir() and not (c10_cuda / "impl" / "cuda_cmake_macros.h").exists():
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    for include in includes:
        flags += ["-isystem", include]
    return flags


def _nvcc_flags() -> list[str]:
    from torch.utils import cpp_extension

    flags = _common_flags() + list(cpp_extension.COMMON_NVCC_FLAGS) + ["--compiler-options", "-fPIC"]
    for arch in CHECK_ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def _host_flags() -> list[str]:
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    return _common_flags() + ["-fPIC", "-fsyntax-only", "-isystem", python_include]


def compile_check(directory: Path = CUDA_DIR) -> tuple[bool, str]:
    """Compile the CUDA extension's sources without building or loading it: nvcc -c of every .cu
    (for sm_80 and sm_90) and the host compiler's -fsyntax-only of every .cpp, in parallel.

    Returns (ok, log): the commands and the compilers' output, or why nothing could be compiled (no
    nvcc, no sources). Works on machines without a GPU and with a CPU build of torch."""
    nvcc = find_nvcc()
    if nvcc is None:
        return False, (
            "nvcc not found: not on PATH and no bin/nvcc under CUDA_HOME or CUDA_PATH; install the "
            "CUDA toolkit (or set CUDA_HOME) to compile the CUDA sources"
        )
    cu_files, cpp_files = sorted(directory.glob("*.cu")), sorted(directory.glob("*.cpp"))
    if not cu_files:
        return False, f"no .cu sources under {directory}"
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cpp_files and cxx is None:
        return False, f"no host C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH) for {cpp_files[0].name}"
    nvcc_flags, host_flags = _nvcc_flags(), _host_flags()
    key = _digest(
        directory,
        [nvcc_version(nvcc), builder.compiler_version(), torch.__version__, " ".join(nvcc_flags), " ".join(host_flags)],
    )
    marker = builder.cache_root() / "cuda-compile-check" / f"{key}.ok"
    if marker.exists():
        return True, f"cached: {marker} (these sources compiled with this nvcc and torch before)\n{marker.read_text()}"

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zero_engine_cuda_check_") as tmp:
        commands = [[nvcc, "-c", str(src), "-o", os.path.join(tmp, f"{src.stem}.o"), *nvcc_flags] for src in cu_files]
        commands += [[str(cxx), str(src), *host_flags] for src in cpp_files]
        ok, log = builder.run_all(commands)
    log += f"{'ok' if ok else 'FAILED'}: {len(commands)} sources in {time.perf_counter() - started:.1f} s\n"
    if ok:
        _remember(marker, log)
    return ok, log


def _remember(marker: Path, log: str) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        partial = marker.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(log)
        os.replace(partial, marker)
    except OSError:  # an unwritable cache only costs a recompile next time
        pass


# ---------------------------------------------------------------- build and load (GPU machines)


def load() -> ModuleType | None:
    """The compiled CUDA extension, building it on first use; None when CUDA is unavailable, the
    fallback is forced, or the build failed (status().reason says which)."""
    return _loader.get()


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return (
            f"CUDA is not available: torch {torch.__version__} is a CPU build; the CUDA ops need a CUDA build "
            "of torch and a GPU"
        )
    return (
        f"CUDA is not available: torch {torch.__version__} is built with CUDA {torch.version.cuda} but sees "
        "no GPU (check the driver and CUDA_VISIBLE_DEVICES)"
    )


def _arch_list() -> str:
    """What torch will compile for: TORCH_CUDA_ARCH_LIST, else the visible GPUs' compute capabilities."""
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or ";".join(f"{a}.{b}" for a, b in sorted(capabilities))


def _load() -> ModuleType | None:
    _status.mode = builder.mode()
    if _status.mode == "fallback":
        _unavailable(f"forced by {ENV_MODE}=fallback")
        return None
    if not torch.cuda.is_available():
        _unavailable(_why_no_cuda())
        return None
    from torch.utils import cpp_extension

    files = sources()
    _status.sources = [str(f.relative_to(builder.ROOT)) for f in files]
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None
    compiler = builder.compiler_version()
    _status.compiler = f"{compiler}; {nvcc_version(nvcc)}" if nvcc else compiler
    if not any(f.suffix == ".cu" for f in files):
        _fail(f"no CUDA sources under {CUDA_DIR} (an installed copy without csrc/; use an editable install)")
        return None
    if nvcc is None or not os.access(nvcc, os.X_OK):
        _fail("the CUDA toolkit was not found (no nvcc); install it or set CUDA_HOME")
        return None
    if not compiler:
        _fail(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH); install g++ or set CXX")
        return None
    if not builder.find_ninja():
        _fail("ninja is not on PATH; pip install ninja (or apt install ninja-build)")
        return None
    key = _digest(
        CUDA_DIR,
        [
            torch.__version__,
            str(torch.version.cuda),
            _status.compiler,
            _arch_list(),
            " ".join(CUDA_FLAGS + HOST_FLAGS),
            sys.version.split()[0],
        ],
    )
    directory = builder.build_dir(NAME, key, _status.compiler)
    _status.cache_dir = str(directory)

    def build() -> ModuleType:
        return cpp_extension.load(
            name=NAME,
            sources=[str(f) for f in files],
            extra_cflags=HOST_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS,
            build_directory=str(directory),
            verbose=False,
        )

    return builder.locked_load(
        _status, directory, NAME, "the CUDA extension", len(files), "several minutes", build, _fail
    )


def _unavailable(reason: str) -> None:
    """Not a failure: nothing to build for (no CUDA) or the fallback was asked for."""
    _status.state, _status.reason = "fallback", reason


def _fail(reason: str) -> None:
    builder.record_failure(_status, reason, "CUDA extension", on=" on CUDA tensors")


_loader: builder.OnceLoader[ModuleType] = builder.OnceLoader(lambda: _load())


def status() -> BuildStatus:
    load()
    return _status


def reset_for_tests() -> None:
    """Forget the loaded module so the next load() reads ZERO_ENGINE_OPS and the CUDA state again."""
    global _status
    _loader.reset()
    _status = BuildStatus()
