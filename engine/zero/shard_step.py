"""The end of every stage's optimizer step, once: stale gradient rows zeroed, then the global norm,
the fp16 overflow vote, and the optimizer step with one factor that averages, unscales and clips
(engine/precision.py's step_shards, engine/zero/master_step.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from engine.precision import Precision
from engine.zero.base import StepOutcome
from engine.zero.shard_reduce import Averaging


def step_on_gradients(precision: Precision, grads: list[torch.Tensor], *,
                      stale: Iterable[torch.Tensor], averaging: Averaging, max_grad_norm: float, partitioned: bool,
                      update: Callable[[float], None]) -> StepOutcome:
    """`grads`: every gradient buffer the optimizer step reads, summed over ranks but not yet averaged;
    `stale`: the parts of them no gradient reached this window (zeroed first); `partitioned`: each rank
    holds a disjoint part (the norm is all-reduced) rather than all of it; `update(coef)`: the step."""
    for rows in stale:
        rows.zero_()
    norm, applied = precision.step_shards(grads, update, max_grad_norm=max_grad_norm, average=averaging.after,
                                          partitioned=partitioned)
    return StepOutcome(norm, applied)
