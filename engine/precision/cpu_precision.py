"""Whether this CPU computes bf16/fp16 matmuls natively, and the warning when it does not.

Without AVX512-BF16 or AMX, torch's CPU kernels convert bf16 to fp32 element by element inside
every matmul: a bf16 training step ran about 13x slower than the same step in fp32 on an AVX2 machine
of this workplace. The same holds for fp16 without AVX512-FP16 or AMX-FP16: an fp16 matmul ran 35x
slower than fp32 on this workplace's AMD EPYC, which has AVX512-BF16 (bf16 there ran 2.2x faster than fp32). The memory saving is real,
the speed is not, so initialize and `python -m engine.report` say so and suggest fp32.
"""

from __future__ import annotations

import logging
import os
import platform

import torch

logger = logging.getLogger("engine")

NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
"""/proc/cpuinfo flags that give native matmuls in each low-precision dtype."""

_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_MEASURED = {
    torch.bfloat16: "a bf16 training step ran about 13x slower than fp32 on an AVX2 machine",
    torch.float16: "an fp16 matmul ran 35x slower than fp32 (2.8 vs 97.6 GFLOP/s, one thread) on an AMD "
    "EPYC with avx512_bf16 but not avx512_fp16",
}
"""What was measured here, quoted in the warning."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def slow_low_precision(dtype: torch.dtype, flags: set[str] | None = None) -> str | None:
    """The warning for training in `dtype` on this CPU, or None when it is fp32 or native here (or the
    flags cannot be read: no claim without evidence)."""
    if dtype not in NATIVE_FLAGS:
        return None
    flags = cpu_flags() if flags is None else flags
    if not flags or any(flag in flags for flag in NATIVE_FLAGS[dtype]):
        return None
    name = _NAMES[dtype]
    return (
        f"{name} compute on this CPU ({platform.processor() or platform.machine()}) has no native "
        f"{name} matmul ({' or '.join(NATIVE_FLAGS[dtype])} missing from /proc/cpuinfo): torch converts "
        f"every element, and {_MEASURED[dtype]}. {name} still "
        f"halves parameter and activation memory; for speed, train in fp32 (remove the {name} section or set "
        "its enabled to false)"
    )


def warn_if_slow(dtype: torch.dtype | None, device: torch.device) -> None:
    """initialize: say it once per node (local rank 0; nodes may have different CPUs)."""
    if dtype is None or device.type != "cpu" or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    message = slow_low_precision(dtype)
    if message:
        logger.warning(message)
