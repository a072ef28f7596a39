"""`clone_tensors_for_torch_save`: DeepSpeed's `deepspeed.checkpoint.utils` helper.

torch.save writes a tensor's whole storage, so a state dict whose tensors are views into a flat
buffer (a ZeRO gradient or parameter buffer, a fused arena) would drag the whole buffer into the file
once per storage. Cloning each tensor first gives it a storage of its own size. Accelerate calls it on
every `get_state_dict` at stages 0-2 (hence every HF Trainer save).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str | None = _CPU) -> Any:
    """A copy of `item` in which every tensor (alone, or nested in dicts, lists and tuples) is a
    detached clone on `device` (None: on the tensor's own device) with storage of its own; other
    values are returned as they are.

    Tensors viewing the same memory in the same way (tied weights: `module.state_dict()` gives each
    name its own detached view of the one parameter) become one clone under each name, so the result
    keeps the sharing the state dict had and HF's save_pretrained still finds its tied weights;
    distinct views of one buffer become distinct small tensors.
    """
    return _clone(item, None if device is None else torch.device(device), {})


def _same_view(tensor: torch.Tensor) -> Hashable:
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return id(tensor)  # no memory to share
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.device,
    )


def _clone(item: Any, device: torch.device | None, seen: dict[Hashable, torch.Tensor]) -> Any:
    if torch.is_tensor(item):
        key = _same_view(item)
        done = seen.get(key)
        if done is None:
            tensor = item.detach()
            # .to() onto another device copies only the view; on the same device it would return the
            # view itself, so clone.
            done = tensor.clone() if device is None or tensor.device == device else tensor.to(device)
            seen[key] = done
        return done
    if isinstance(item, dict):
        return type(item)({k: _clone(v, device, seen) for k, v in item.items()})
    if isinstance(item, list):
        return [_clone(v, device, seen) for v in item]
    if isinstance(item, tuple):
        values = [_clone(v, device, seen) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else tuple(values)  # namedtuples keep their type
    return item
