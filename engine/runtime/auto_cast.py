"""fp16.auto_cast: the engine's forward casts floating positional inputs to fp16, as DeepSpeed does.

An fp16 model fed fp32 activations fails (or silently upcasts); with auto_cast the loop can keep
building fp32 batches. Like DeepSpeed, only positional inputs are cast, recursively through lists,
tuples and dicts; keyword inputs pass unchanged (a float attention mask of large negatives given by
keyword keeps its fp32 range), and integer tensors (token ids, labels) are never touched.
"""

from __future__ import annotations

from typing import Any

import torch


def to_half(value: Any) -> Any:
    """`value` with every floating tensor in it cast to torch.float16 (containers rebuilt, same types)."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: to_half(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        cast = [to_half(v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: rebuilt field by field
            return type(value)(*cast)
        return type(value)(cast)
    return value
