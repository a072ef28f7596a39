"""Stage-3 parameters that say so when user code reads them while they hold no data.

Between uses a stage-3 parameter is released: `param.data` is empty (`numel() == 0`, as in DeepSpeed)
and `param.ds_shape` keeps the full shape. Code outside forward that computes with it
(`param.sum()`, `model.state_dict()`, a custom logging hook) would get an empty tensor and carry on
silently. The stage gives its parameters this Parameter subclass: any torch operation on a released
one, other than reading its metadata or registering hooks, warns once per process, naming the
parameter and the fix. Operations on gathered parameters (all of forward and backward) pass straight
through; the check costs one attribute read per tensor argument.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch
from torch._C import DisableTorchFunctionSubclass


class ReleasedParameterWarning(UserWarning):
    """A partitioned (released) stage-3 parameter was read outside forward."""


# The attributes a ZeroParameter carries (set with setattr: torch.nn.Parameter declares neither).
_NAME, _RELEASED = "_zero_name", "_zero_released"

# Reading these does not touch the (missing) values.
_METADATA = frozenset({
    "__get__", "__set__", "numel", "nelement", "size", "dim", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "__hash__",
    "__reduce_ex__", "__deepcopy__", "__setstate__", "data_ptr", "untyped_storage", "_is_view", "type",
    "get_device", "is_shared", "share_memory_",
})


class ZeroParameter(torch.nn.Parameter):
    """A stage-3 parameter; `_zero_released` is set by the stage while it holds no data."""

    _warned: ClassVar[bool] = False

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        with DisableTorchFunctionSubclass():
            if not cls._warned and getattr(func, "__name__", "") not in _METADATA:
                for arg in args:
                    if isinstance(arg, ZeroParameter) and getattr(arg, _RELEASED, False):
                        cls._warn(arg, func)
                        break
            return func(*args, **(kwargs or {}))

    @classmethod
    def _warn(cls, param: ZeroParameter, func: Any) -> None:
        cls._warned = True
        name = getattr(param, _NAME, "?")
        shape = tuple(getattr(param, "ds_shape", param.shape))
        warnings.warn(
            f"stage 3: parameter {name!r} (shape {shape}) was used by "
            f"{getattr(func, '__name__', func)} outside forward while partitioned; here it holds no data "
            "(numel() == 0). Read it inside `with engine.zero.GatheredParameters(param):`, or take the "
            "whole model with engine.consolidated_state_dict(). (Warned once per process.)",
            ReleasedParameterWarning, stacklevel=3)


def adopt(param: torch.nn.Parameter, name: str) -> None:
    """Make a stage-3 parameter a ZeroParameter (in place: every module and user reference keeps it)."""
    param.__class__ = ZeroParameter
    setattr(param, _NAME, name)
    set_released(param, True)


def set_released(param: torch.Tensor, released: bool) -> None:
    """Stage 3 marks `param` released (its `.data` is empty) or gathered (a view of its unit)."""
    setattr(param, _RELEASED, released)


def give_back(param: torch.nn.Parameter) -> None:
    param.__class__ = torch.nn.Parameter
    for attr in (_NAME, _RELEASED):
        if attr in param.__dict__:
            delattr(param, attr)
