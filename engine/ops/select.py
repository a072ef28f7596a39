"""Which compiled module runs an op on these tensors: the CPU extension for CPU tensors, the CUDA
extension for CUDA tensors, None (the torch fallback) for anything else or when that module is
unavailable. Every op in engine/ops dispatches through here, so one place decides."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch

from engine.ops import builder, cuda_builder


def compiled_module(tensors: Iterable[torch.Tensor]) -> ModuleType | None:
    devices = {t.device for t in tensors}
    if not devices or devices == {torch.device("cpu")}:
        return builder.load()
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return cuda_builder.load()
    return None  # mixed or other devices: the fallback handles (or rejects) them
