"""What a stage-3 rank holds, by kind: the tensors behind each state `engine.offload_states` moves, and the
bytes memory_report() gives (both read the units' groups and the optimizer's state the same way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.zero.offload_states import OffloadStateTypeEnum
from engine.zero.stage3.units import Unit


def _state(units: Sequence[Unit], optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's state tensors of the trainable groups' masters; its 0-d scalars (Adam's step) are left
    out: a few bytes, kept where they are."""
    opt_state = optimizer.state if optimizer is not None else {}
    return [
        v
        for u in units
        for g in u.trainable
        for v in opt_state.get(g.master, {}).values()
        if torch.is_tensor(v) and v.dim() > 0
    ]


def resident_states(
    units: Sequence[Unit], optimizer: torch.optim.Optimizer | None
) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    trainable = [g for u in units for g in u.trainable]
    return {
        OffloadStateTypeEnum.lp_params: [g.shard for u in units for g in u.groups if g.shard is not None],
        OffloadStateTypeEnum.hp_params: [g.master for g in trainable],
        OffloadStateTypeEnum.lp_grads: [g.shard_grad for g in trainable],
        OffloadStateTypeEnum.optim_states: _state(units, optimizer),
    }


def held_bytes(units: Sequence[Unit], optimizer: torch.optim.Optimizer | None, grads_on_disk: bool) -> dict[str, int]:
    """Bytes of parameters (shards), masters kept apart from them, gradients (0 when they live on disk: counted
    under "nvme") and optimizer state."""

    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    trainable = [g for u in units for g in u.trainable]
    return {
        "params": sum(nbytes(g.shard) for u in units for g in u.groups),
        "master": sum(nbytes(g.master) for g in trainable if g.shard is None),
        "gradients": 0 if grads_on_disk else sum(nbytes(g.shard_grad) for g in trainable),
        "optimizer_state": sum(nbytes(v) for v in _state(units, optimizer)),
    }
