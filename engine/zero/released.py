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

import enum
import warnings
from typing import Any, ClassVar

import torch
from torch._C import DisableTorchFunctionSubclass

from engine.zero import owners


class ReleasedParameterWarning(UserWarning):
    """A partitioned (released) stage-3 parameter was read outside forward."""


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `param.ds_status` values (deepspeed.runtime.zero.partition_parameters.ZeroParamStatus):
    TRL reads them to gather only what is not gathered already."""

    AVAILABLE = 1
    """Gathered: `.data` is the whole parameter (a view of its unit's buffer)."""
    NOT_AVAILABLE = 2
    """Released: `.data` is empty; this rank keeps its slice of the unit."""
    INFLIGHT = 3
    """Its unit's all-gather was started (a prefetch) and not yet waited for."""


# The attributes a ZeroParameter carries (set with setattr: torch.nn.Parameter declares neither).
_NAME, _RELEASED, _PARTITION_NUMEL = "_zero_name", "_zero_released", "_zero_partition_numel"

# Reading these does not touch the (missing) values.
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "numel",
        "nelement",
        "size",
        "dim",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "__hash__",
        "__reduce_ex__",
        "__deepcopy__",
        "__setstate__",
        "data_ptr",
        "untyped_storage",
        "_is_view",
        "type",
        "get_device",
        "is_shared",
        "share_memory_",
    }
)


class ZeroParameter(torch.nn.Parameter):
    """A stage-3 parameter; `_zero_released` is set by the stage while it holds no data."""

    _warned: ClassVar[bool] = False

    @property
    def ds_status(self) -> ZeroParamStatus:
        """DeepSpeed's: AVAILABLE while its unit is gathered, INFLIGHT while the unit's gather is in flight,
        else NOT_AVAILABLE; read from the unit's state (UnitState), the one record of it."""
        handle = owners.unit_of(self)
        return handle.status() if handle is not None else ZeroParamStatus.NOT_AVAILABLE

    def partition_numel(self) -> int:
        """DeepSpeed's: elements of this parameter that this rank stores (its part of the unit's slice;
        Lightning's model summary sums them)."""
        numel: int = getattr(self, _PARTITION_NUMEL, 0)
        return numel

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
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
            ReleasedParameterWarning,
            stacklevel=3,
        )


def adopt(param: torch.nn.Parameter, name: str, partition_numel: int) -> None:
    """Make a stage-3 parameter a ZeroParameter (in place: every module and user reference keeps it);
    `partition_numel`: its elements in this rank's slice."""
    param.__class__ = ZeroParameter
    setattr(param, _NAME, name)
    setattr(param, _PARTITION_NUMEL, partition_numel)
    set_released(param, True)


def set_released(param: torch.Tensor, released: bool) -> None:
    """Stage 3 marks `param` released (its `.data` is empty) or gathered (a view of its unit)."""
    setattr(param, _RELEASED, released)


def give_back(param: torch.nn.Parameter) -> None:
    param.__class__ = torch.nn.Parameter
    for attr in (_NAME, _RELEASED, _PARTITION_NUMEL):
        if attr in param.__dict__:
            delattr(param, attr)


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when it is already partitioned (engine.zero.Init)."""
    return getattr(param, "ds_numel", None) or param.numel()
