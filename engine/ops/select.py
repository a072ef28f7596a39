"""Which compiled ops run an op on these tensors: the CPU library (engine/ops/cpu_lib.CpuOps) for CPU
tensors, the CUDA extension for CUDA tensors, None (the torch fallback) for anything else or when that
one is unavailable. Every op in engine/ops dispatches through here, so one place decides; both offer
the same functions with the same arguments."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.ops import builder, cuda_builder

if TYPE_CHECKING:
    from engine.ops.cpu_lib import CpuOps


def compiled_module(tensors: Iterable[torch.Tensor]) -> CpuOps | ModuleType | None:
    devices = {t.device for t in tensors}
    if not devices or devices == {torch.device("cpu")}:
        return builder.load()
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return cuda_builder.load()
    return None  # mixed or other devices: the fallback handles (or rejects) them
