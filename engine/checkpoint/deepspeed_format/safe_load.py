"""Reading one of DeepSpeed's checkpoint files without running anything it holds.

DeepSpeed pickles a few of its own objects into its files: the loss scaler (LossScaler,
DynamicLossScaler), the ZeRO stage (the ZeroStageEnum), and the address of every parameter's fragment
in a flat partition (fragment_address). torch.load(weights_only=True) refuses them, and loading with
weights_only=False would import DeepSpeed and let the file call any function. Here each of those
exact names is mapped to a stand-in of ours (`torch.serialization.safe_globals` with
(stand-in, "deepspeed....Name") pairs): the weights-only unpickler builds the stand-in from the
saved attributes, which stay plain data, and refuses every other global by name.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from engine.checkpoint.files import CheckpointError, load_dict


class DeepSpeedObject:
    """The attributes a DeepSpeed object was pickled with, as a plain dict (`state`); no behaviour."""

    ds_class = "object"

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        # DeepSpeed's classes pickle their __dict__; a (dict, slots) pair is flattened the same way.
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, dict) else {"value": state}

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    def __repr__(self) -> str:
        return f"{self.ds_class}({self.state})"


class LossScalerState(DeepSpeedObject):
    ds_class = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScalerState(DeepSpeedObject):
    ds_class = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(DeepSpeedObject):
    ds_class = "deepspeed.utils.tensor_fragment.fragment_address"


def zero_stage_value(value: Any) -> int:
    """ZeroStageEnum(value) as DeepSpeed pickles it (the enum called with its value): the stage number."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r}) is not a ZeRO stage (0-3)")
    return value


# Every DeepSpeed global this reader accepts, and what it becomes. Anything else in a file is refused.
_STAND_INS: list[tuple[Any, str]] = [
    (LossScalerState, LossScalerState.ds_class),
    (DynamicLossScalerState, DynamicLossScalerState.ds_class),
    (FragmentAddress, FragmentAddress.ds_class),
    (zero_stage_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load_deepspeed_file(path: str) -> dict[str, Any]:
    """One DeepSpeed file, memory-mapped, DeepSpeed's objects as stand-ins. A missing, truncated or
    refused file is a CheckpointError naming it (and, when refused, the global it holds)."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing; the DeepSpeed checkpoint is incomplete (a rank's file was not "
            "written or not copied); load another tag"
        )
    with torch.serialization.safe_globals(list(_STAND_INS)):
        return load_dict(
            path,
            refused=lambda reason: (
                f"this engine does not read from a DeepSpeed checkpoint ({reason}); it was not loaded and "
                f"nothing in it was run. The objects read are DeepSpeed's {', '.join(n for _, n in _STAND_INS)}"
            ),
            holds="a DeepSpeed checkpoint state dict",
            retry="load another tag",
        )
