"""`python -m engine.report`: what this machine gives the engine (like DeepSpeed's ds_report).

Prints torch and CUDA, the compilers, the SIMD level, and for each op of the C++ extension whether
it is compiled, cached or on the torch fallback, with the reason. Building happens here if it has
not yet (the same as the first training run would do).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import torch

from engine.ops import builder, cuda_builder
from engine.precision import cpu_precision

OPS = {
    "copy_into / copy_out": "fused multi-tensor flatten/unflatten with cast and scale (engine/ops/flatten.py)",
    "sum_squares_and_overflow": "fused overflow check + sum of squares (engine/ops/overflow.py)",
    "adam_step": "fused Adam/AdamW with unscale, clip and low-precision copy-out (engine/ops/adam.py)",
    "Arena": "contiguous pre-touched memory arena (engine/ops/arena.py)",
}


def _first_line(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return "not found"
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in (out.stdout or out.stderr).splitlines() if line.strip()]
    return lines[-1].strip() if command[0] == "nvcc" and lines else (lines[0].strip() if lines else "?")


def lines() -> list[str]:
    status = builder.status()
    cuda_ext = cuda_builder.status()
    cuda = (
        f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"
        if torch.cuda.is_available()
        else f"not available (torch built with CUDA {torch.version.cuda})"
        if torch.version.cuda
        else "not available (CPU build of torch)"
    )
    out = [
        "zero-engine report",
        "-" * 60,
        f"python ................ {platform.python_version()}",
        f"torch ................. {torch.__version__}",
        (
            f"torch installation .... {os.path.dirname(os.path.abspath(torch.__file__))} (build key "
            f"{builder.installation_key(status.compiler or builder.compiler_version())}: one cache per installation)"
        ),
        f"CUDA .................. {cuda}",
        f"C++ compiler .......... {status.compiler or 'not found'}",
        f"nvcc .................. {_first_line(['nvcc', '--version'])}",
        f"ninja ................. {_first_line(['ninja', '--version'])}",
        f"ZERO_ENGINE_OPS ....... {status.mode}",
        f"extension ............. {status.state}"
        + (f" ({status.reason})" if status.reason else "")
        + (f" in {status.seconds:.1f} s" if status.state == "compiled" else ""),
        f"SIMD level ............ {status.simd}",
        f"cache ................. {status.cache_dir or '-'}",
        f"CUDA extension ........ {cuda_ext.state}" + (f" ({cuda_ext.reason})" if cuda_ext.reason else ""),
        "-" * 60,
    ]
    native = status.state in ("compiled", "cached")
    for op, what in OPS.items():
        state = "compiled" if native else "fallback"
        out.append(f"{op:<26} {state:<9} {what}")
    if not native:
        out.append(f"(fallback because: {status.reason})")
    out.append("-" * 60)
    flags = cpu_precision.cpu_flags()
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        native_here = sorted(set(cpu_precision.NATIVE_FLAGS[dtype]) & flags)
        out.append(
            f"CPU {name} matmul ......... "
            + (
                f"native ({', '.join(native_here)})"
                if native_here
                else "unknown (no /proc/cpuinfo flags)"
                if not flags
                else "converted per element (no native instructions)"
            )
        )
        warning = cpu_precision.slow_low_precision(dtype, flags)
        if warning:
            out.append(f"WARNING: {warning}")
    return out


def main() -> None:
    print("\n".join(lines()))


if __name__ == "__main__":
    main()
