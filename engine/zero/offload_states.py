"""The names `engine.offload_states(include=..., device=...)` takes: DeepSpeed's `OffloadStateTypeEnum` and
`OffloadDeviceEnum` (deepspeed.runtime.zero.offload_config), and their checks.

What each kind is, in every stage (a stage lists its tensors in `resident_states()`):
- optim_states: the optimizer's state (Adam's moments, its step counts);
- hp_params: the fp32 master of this rank's parameters (in fp32 training also the parameters themselves);
- lp_params: the parameters the forward reads (stages 0-2: the whole flat buffers; stage 3: this rank's shards);
- lp_grads: the reduced gradients (and at stages 0-1 the accumulation buffer);
- contiguous_grad_buffer: the reusable gradient bucket buffers, scratch between steps (dropped, made again on
  the next backward).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def state_kinds(include: Iterable[OffloadStateTypeEnum | str] | None) -> list[OffloadStateTypeEnum]:
    """`include` as kinds (None: every kind); an unknown name is refused, listing the known ones."""
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, str):
        include = [include]
    kinds = []
    for item in include:
        try:
            kinds.append(OffloadStateTypeEnum(item))
        except ValueError:
            known = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; the states are {known}") from None
    return kinds


def offload_device(device: OffloadDeviceEnum | str) -> OffloadDeviceEnum:
    try:
        return OffloadDeviceEnum(device)
    except ValueError:
        known = ", ".join(repr(d.value) for d in OffloadDeviceEnum)
        raise ValueError(f"offload_states(device={device!r}): unknown device; use one of {known}") from None
