"""The end of every stage's optimizer step, once, in this order:

1. stale rows: the parts of the gradient buffers no reduction wrote this window are zeroed;
2. the global norm: each rank's sum of squares of the rows it counts (engine/zero/norm_scope.py says
   which), added by one all-reduce (never a gather), times the factor that averages and unscales;
3. the vote: an inf or nan anywhere makes the sum non-finite on every rank, so the same all-reduce is
   the overflow check all ranks agree on, and the step is skipped on all of them together (fp16: the
   loss scaler's overflow; fp32/bf16: the Engine warns or raises NonFiniteGradientError);
4. clipping: folded into the same factor (like torch.nn.utils.clip_grad_norm_);
5. the update: `update(coef)` (engine/zero/master_step.py), which applies the one factor to each
   gradient as it reads it; then the loss scale follows the outcome.

Precision (engine/precision/) answers only precision questions here: the loss scale to divide by, and
what the loss scale does after a clean or an overflowed step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine import comm
from engine.ops.overflow import KnownSquares, sum_squares_of
from engine.precision import Precision
from engine.zero.base import StepOutcome
from engine.zero.norm_scope import NormScope
from engine.zero.shard_reduce import Averaging


@dataclass(frozen=True)
class GradNorm:
    """The result of one global gradient-norm reduction."""

    norm: float
    """Global L2 norm of the averaged, unscaled gradient (inf/nan on overflow)."""
    overflow: bool


def global_norm(rows: Sequence[torch.Tensor | KnownSquares], *, factor: float, scope: NormScope) -> GradNorm:
    """Global L2 norm of `factor x` the gradients whose pieces this rank counts are `rows` (1-D,
    contiguous), or partial sums of some taken earlier (KnownSquares, engine/ops/overflow.py: the same
    norm, bitwise), added up over `scope`."""
    # One fused pass over every row (engine/ops/overflow.py), in the rows' own dtype: the sum of
    # squares in float64 and whether any element is inf/nan, which makes the sum nan (a nan element)
    # or inf so the all-reduce carries it, and the norm says which.
    local, overflow = sum_squares_of(rows)
    if overflow:
        local = math.nan if math.isnan(local) else math.inf
    sumsq = torch.tensor([local], dtype=torch.float32)
    if scope.reduce and comm.group_size(scope.group) > 1:
        comm.all_reduce(sumsq, group=scope.group)
    total = float(sumsq) ** 0.5 * abs(factor)
    return GradNorm(total, overflow=not math.isfinite(total))


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
    added up over `scope`; `stale`: the parts of the buffers no gradient reached this window (zeroed
    first); `update(coef)`: the step. See the module docstring for the phases."""
    # 1. Stale rows.
    for rows in stale:
        rows.zero_()
    # 2. The global norm of the averaged, unscaled gradient.
    factor = averaging.after / precision.loss_scale
    norm = global_norm(norm_rows(), factor=factor, scope=scope)
    # 3. The vote: every rank saw the same all-reduced norm, so every rank skips together.
    if norm.overflow:
        precision.after_step(overflow=True)
        return StepOutcome(norm.norm, applied=False)
    # 4. Clipping, folded into the one factor.
    coef = factor
    if max_grad_norm > 0 and norm.norm + 1e-6 > max_grad_norm:
        coef *= max_grad_norm / (norm.norm + 1e-6)
    # 5. The update, then the loss scale.
    update(coef)
    precision.after_step(overflow=False)
    return StepOutcome(norm.norm, applied=True)
