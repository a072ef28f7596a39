"""`clone_tensors_for_torch_save`: DeepSpeed's `deepspeed.checkpoint.utils` helper.

torch.save writes a tensor's whole storage, so a state dict whose tensors are views into a flat
buffer (a ZeRO gradient or parameter buffer, a fused arena) would drag the whole buffer into the file
once per storage. Cloning each tensor first gives it a storage of its own size. Accelerate calls it on
every `get_state_dict` at stages 0-2 (hence every HF Trainer save).
"""

from __future__ import annotations

from typing import Any

import torch

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _CPU) -> Any:
    """A copy of `item` in which every tensor (alone, or nested in dicts, lists and tuples) is a
    detached clone on `device` with storage of its own; other values are returned as they are.

    The same tensor object met twice (tied weights in a state dict) becomes one clone met twice, so
    the result keeps the sharing `module.state_dict()` had; distinct views of one buffer become
    distinct small tensors.
    """
    return _clone(item, torch.device(device), {})


def _clone(item: Any, device: torch.device, seen: dict[int, torch.Tensor]) -> Any:
    if torch.is_tensor(item):
        done = seen.get(id(item))
        if done is None:
            tensor = item.detach()
            # .to() onto another device copies only the view; on the same device it would return the
            # view itself, so clone.
            done = tensor.clone() if tensor.device == device else tensor.to(device)
            seen[id(item)] = done
        return done
    if isinstance(item, dict):
        return type(item)({k: _clone(v, device, seen) for k, v in item.items()})
    if isinstance(item, list):
        return [_clone(v, device, seen) for v in item]
    if isinstance(item, tuple):
        values = [_clone(v, device, seen) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else tuple(values)  # namedtuples keep their type
    return item
