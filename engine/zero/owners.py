"""Which stage owns a parameter, for `engine.zero.GatheredParameters` and the stage-3 linear.

A registry keyed by the parameter object (weakly, by identity: a Parameter's `==` is elementwise),
instead of attributes set on the user's Parameters: the stage that owns a parameter is found with
its real type, and a destroyed stage leaves nothing behind on the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.unsupported import UnsupportedFeatureError
from engine.zero.base import MasterOwner

if TYPE_CHECKING:
    from engine.zero.fragments import HeldState
    from engine.zero.released import ZeroParamStatus


@dataclass(frozen=True, eq=False)
class UnitHandle:
    """One stage-3 gather unit, as GatheredParameters uses it."""

    gather: Callable[[], bool]
    """Gather the unit; False when it was gathered already (then leave it so)."""
    release: Callable[[], None]
    scatter_from: Callable[[int], None]
    """Every rank takes rank src's values of the gathered unit into its shard and fp32 master."""
    status: Callable[[], ZeroParamStatus]
    """DeepSpeed's `param.ds_status` of the unit's parameters, from its state (Unit.ds_status)."""
    grad_slot: Callable[[torch.Tensor, torch.dtype], torch.Tensor | None] = lambda param, dtype: None
    """Where the parameter's gradient of this backward goes in the unit's gradient bucket, shaped like the
    parameter, for the stage-3 linear to compute it into; None: return it the usual way (UnitGradients.slot)."""


_units = WeakIdKeyDictionary()  # stage-3 parameter -> UnitHandle
_masters = WeakIdKeyDictionary()  # flat-stage parameter -> the stage holding its fp32 master
_held = WeakIdKeyDictionary()  # trainable parameter of any stage -> its stage's HeldState (fragments.py)


def set_unit(param: torch.Tensor, handle: UnitHandle | None) -> None:
    if handle is None:
        _units.pop(param, None)
    else:
        _units[param] = handle


def unit_of(param: torch.Tensor) -> UnitHandle | None:
    """The stage-3 unit holding `param`, or None (not partitioned by an engine)."""
    handle = _units.get(param)
    return handle if isinstance(handle, UnitHandle) else None


def check_not_held(module: torch.nn.Module) -> None:
    """Refuse a module whose parameters a live stage-3 engine holds. That engine keeps their values in its
    own shards and leaves each parameter empty, so a second engine would lay out empty tensors (and the
    first would keep stale values if it could gather them). DeepSpeed shares one partition per parameter
    between engines; this engine does not."""
    for name, p in module.named_parameters():
        if unit_of(p) is not None:
            raise UnsupportedFeatureError(
                f"engine.initialize: parameter {name!r} is partitioned by another ZeRO stage 3 engine that is "
                "still alive; one module cannot be given to two engines here (each keeps its own shards). Call "
                "destroy() on the other engine first, or give initialize a separate copy of the model. TRL's "
                "DPOTrainer(precompute_ref_log_probs=True) does this at stage 3 (its log-prob pass wraps the "
                "policy in an inference engine that it keeps): set precompute_ref_log_probs=False (a separate "
                "reference model, TRL's default) or train at ZeRO stage 2"
            )


def set_masters(param: torch.Tensor, owner: MasterOwner | None) -> None:
    if owner is None:
        _masters.pop(param, None)
    else:
        _masters[param] = owner


def masters_of(param: torch.Tensor) -> MasterOwner | None:
    """The flat stage keeping an fp32 master of `param`, or None."""
    owner: MasterOwner | None = _masters.get(param)
    return owner


def set_held(param: torch.Tensor, held: HeldState | None) -> None:
    if held is None:
        _held.pop(param, None)
    else:
        _held[param] = held


def held_of(param: torch.Tensor) -> HeldState | None:
    """The HeldState of the stage training `param` (its fp32 value, gradient and optimizer state), or None:
    frozen, or not given to an engine."""
    held: HeldState | None = _held.get(param)
    return held


def grad_is_ready(param: torch.Tensor) -> bool:
    """DeepSpeed's `param.ds_grad_is_ready`: False while code that backpropagates in pieces (ALST's tiled
    compute, engine/sequence/tiled.py) has more pieces of this parameter's gradient to add. A stage then
    leaves the gradient in `param.grad`, where autograd keeps adding, and takes it at the last piece."""
    return bool(getattr(param, "ds_grad_is_ready", True))
