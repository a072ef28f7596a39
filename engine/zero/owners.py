"""Which stage owns a parameter, for `engine.zero.GatheredParameters` and the stage-3 linear.

A registry keyed by the parameter object (weakly, by identity: a Parameter's `==` is elementwise),
instead of attributes set on the user's Parameters: the stage that owns a parameter is found with
its real type, and a destroyed stage leaves nothing behind on the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.zero.base import MasterOwner


@dataclass(frozen=True, eq=False)
class UnitHandle:
    """One stage-3 gather unit, as GatheredParameters uses it."""

    gather: Callable[[], bool]
    """Gather the unit; False when it was gathered already (then leave it so)."""
    release: Callable[[], None]
    scatter_from: Callable[[int], None]
    """Every rank takes rank src's values of the gathered unit into its shard and fp32 master."""


_units = WeakIdKeyDictionary()  # stage-3 parameter -> UnitHandle
_masters = WeakIdKeyDictionary()  # flat-stage parameter -> the stage holding its fp32 master


def set_unit(param: torch.Tensor, handle: UnitHandle | None) -> None:
    if handle is None:
        _units.pop(param, None)
    else:
        _units[param] = handle


def unit_of(param: torch.Tensor) -> UnitHandle | None:
    """The stage-3 unit holding `param`, or None (not partitioned by an engine)."""
    handle = _units.get(param)
    return handle if isinstance(handle, UnitHandle) else None


def set_masters(param: torch.Tensor, owner: MasterOwner | None) -> None:
    if owner is None:
        _masters.pop(param, None)
    else:
        _masters[param] = owner


def masters_of(param: torch.Tensor) -> MasterOwner | None:
    """The flat stage keeping an fp32 master of `param`, or None."""
    owner: MasterOwner | None = _masters.get(param)
    return owner
