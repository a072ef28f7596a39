"""The end of every stage's optimizer step, once: stale gradient rows zeroed, then the global norm,
the fp16 overflow vote, one multiply that averages, unscales and clips, and the optimizer step
(engine/precision.py's step_shards)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from engine.precision import Precision
from engine.zero.base import StepOutcome
from engine.zero.shard_reduce import Averaging


def step_on_gradients(precision: Precision, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], *,
                      stale: Iterable[torch.Tensor], averaging: Averaging, max_grad_norm: float, partitioned: bool,
                      fused_step: Callable[[float], None] | None = None) -> StepOutcome:
    """`grads`: every fp32 gradient buffer the optimizer reads, summed over ranks but not yet averaged;
    `stale`: the parts of them no gradient reached this window (zeroed first); `partitioned`: each rank
    holds a disjoint part (the norm is all-reduced) rather than all of it."""
    for rows in stale:
        rows.zero_()
    norm, applied = precision.step_shards(grads, optimizer, max_grad_norm=max_grad_norm, average=averaging.after,
                                          partitioned=partitioned, fused_step=fused_step)
    return StepOutcome(norm, applied)
