"""What a stage 0-2 rank holds, by kind: the tensors behind each state `engine.offload_states` moves, and the
bytes memory_report() gives from the same lists (views count once, with their storage: an fp32 group's master
is a view of its flat parameters)."""

from __future__ import annotations

import torch

from engine.zero.flat_groups import FlatGroup
from engine.zero.offload_states import OffloadStateTypeEnum


def resident_states(
    groups: list[FlatGroup], optimizer: torch.optim.Optimizer, gradient_buffers: list[torch.Tensor]
) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """The optimizer's 0-d scalars (Adam's step) are left out: a few bytes, kept where they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        OffloadStateTypeEnum.lp_params: [g.flat for g in groups],
        OffloadStateTypeEnum.hp_params: [g.master for g in groups],
        OffloadStateTypeEnum.lp_grads: [*gradient_buffers, *(g.shard_grad for g in groups)],
        OffloadStateTypeEnum.optim_states: [
            v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()
        ],
    }


def held_bytes(held: dict[OffloadStateTypeEnum, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per model-state category, each storage counted once (in the first category that has it)."""
    seen: set[int] = set()

    def nbytes(tensors: list[torch.Tensor]) -> int:
        fresh = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors) if s.data_ptr() not in seen}
        seen.update(fresh)
        return sum(fresh.values())

    return {
        "params": nbytes(held[OffloadStateTypeEnum.lp_params]),
        "master": nbytes(held[OffloadStateTypeEnum.hp_params]),
        "gradients": nbytes(held[OffloadStateTypeEnum.lp_grads]),
        "optimizer_state": nbytes(held[OffloadStateTypeEnum.optim_states]),
    }
