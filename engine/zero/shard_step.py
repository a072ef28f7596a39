"""The end of every stage's optimizer step, once: stale gradient rows zeroed, then the global norm,
the vote on an inf/nan norm (which skips the step), and the optimizer step with one factor that
averages, unscales and clips (engine/precision/policy.py's step_shards, engine/zero/master_step.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from engine.ops.overflow import KnownSquares
from engine.precision import Precision
from engine.zero.base import StepOutcome
from engine.zero.norm_scope import NormScope
from engine.zero.shard_reduce import Averaging


def step_on_gradients(
    precision: Precision,
    norm_rows: Callable[[], Sequence[torch.Tensor | KnownSquares]],
    *,
    stale: Iterable[torch.Tensor],
    averaging: Averaging,
    max_grad_norm: float,
    scope: NormScope,
    update: Callable[[float], None],
) -> StepOutcome:
    """`norm_rows()`: the pieces of the gradient buffers the optimizer step reads (summed over ranks but
    not yet averaged) that this rank counts in the global norm (or their partial sums, KnownSquares),
    added up over `scope`
    (engine/zero/norm_scope.py); `stale`: the parts of the buffers no gradient reached this window
    (zeroed first); `update(coef)`: the step."""
    for rows in stale:
        rows.zero_()
    norm, applied = precision.step_shards(
        norm_rows(), update, max_grad_norm=max_grad_norm, average=averaging.after, scope=scope
    )
    return StepOutcome(norm, applied)
