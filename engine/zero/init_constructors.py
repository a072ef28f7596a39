"""torch's tensor constructors as `engine.zero.Init(dtype=...)` wraps them (DeepSpeed's names, which
engine/zero/partitioned_init.py, DeepSpeed's `partition_parameters` for transformers, re-exports: transformers
compares against `_orig_torch_arange` and replaces `zero_wrapper_for_fp_tensor_constructor` there, where Init
looks it up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch's constructors as they were when the engine was imported (DeepSpeed's names: transformers
# compares against `_orig_torch_arange`). Init wraps these and puts them back.
_CONSTRUCTORS: dict[str, Callable[..., torch.Tensor]] = {
    name: getattr(torch, name) for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
}
_orig_torch_tensor, _orig_torch_empty, _orig_torch_zeros, _orig_torch_ones = (
    _CONSTRUCTORS[n] for n in ("tensor", "empty", "zeros", "ones")
)
_orig_torch_full, _orig_torch_arange, _orig_torch_eye, _orig_torch_randn = (
    _CONSTRUCTORS[n] for n in ("full", "arange", "eye", "randn")
)


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: torch.device | None = None
) -> Callable[..., torch.Tensor]:
    """`fn` (a torch tensor constructor) making floating-point tensors in `target_fp_dtype` and, when
    no device is given, on `target_device`. A dtype the caller names is kept; `out=` is left alone."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        named_dtype = kwargs.get("dtype") is not None
        tensor = fn(*args, **kwargs)
        if (
            target_fp_dtype is not None
            and not named_dtype
            and "out" not in kwargs
            and tensor.is_floating_point()
            and tensor.dtype != target_fp_dtype
        ):
            tensor.data = tensor.data.to(target_fp_dtype)  # in place of .to(): a leaf stays a leaf (requires_grad=)
        return tensor

    return wrapped
