"""Mixed precision shared by every stage: the model's dtype, the wire and accumulation dtypes, loss
scaling, and the global-norm / overflow computation over gradient shards.

bf16 and fp16 configs cast the model to that dtype; the stages keep an fp32 master copy for every
flat group whose dtype is not fp32 (fp32 groups need none: the optimizer updates them in place).
fp16 scales the loss (engine/precision/loss_scaler.py); an overflow anywhere skips the step on every rank.
fp32 and bf16 skip the same way when the global gradient norm is inf/nan (a NaN or inf loss on any
rank would otherwise write NaN into every weight), with a warning, or stop with NonFiniteGradientError
when the config sets check_for_nan_in_loss_and_grad.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import comm
from engine.config.types import EngineConfig
from engine.ops.overflow import KnownSquares, sum_squares_of
from engine.precision.loss_scaler import LossScaler

if TYPE_CHECKING:
    from engine.zero.norm_scope import NormScope

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name.lower()]


@dataclass(frozen=True)
class GradNorm:
    """The result of one global gradient-norm reduction."""

    norm: float
    """Global L2 norm of the averaged, unscaled gradient (inf/nan on overflow)."""
    overflow: bool


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm of an optimizer step was inf or nan and the config sets
    check_for_nan_in_loss_and_grad. Raised on every rank together (the norm is all-reduced, so every
    rank sees it) before anything is updated: weights, optimizer state, LR schedule and step counters
    are as before the step, and the step's gradients were dropped."""

    def __init__(self, step: int, norm: float, rank: int) -> None:
        super().__init__(
            f"step {step}: the global gradient norm is {norm} on rank {rank} (the norm is all-reduced, so every rank "
            "stops here): the loss or a gradient of this step is NaN or infinite on at least one rank, and "
            '"check_for_nan_in_loss_and_grad": true stops training on it. Nothing was updated: the weights, the '
            "optimizer state, the LR schedule and the step counters are as before the step and its gradients were "
            "dropped, so the process can save a checkpoint or run the step again. Fix the cause (a NaN or inf in "
            "the inputs or labels, a log or division of zero, a learning rate too high; "
            "torch.autograd.set_detect_anomaly(True) names the operation that produced it), or remove the key to "
            "skip such steps with a warning instead (counted in engine.skipped_steps)"
        )


class Precision:
    """The dtypes and loss scaler of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        if config.fp16.enabled:
            self.model_dtype: torch.dtype | None = torch.float16
        elif config.bf16.enabled:
            self.model_dtype = torch.bfloat16
        else:
            self.model_dtype = None  # keep the model's own dtypes
        self.scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self.comm_dtype = dtype_from_name(config.communication_data_type)
        """dtype gradients travel in; None = the gradient's own dtype (DeepSpeed's default)."""
        self.accum_dtype = dtype_from_name(config.grad_accum_dtype)
        """dtype of the full-size gradient accumulation buffer; None = the parameter's dtype."""

    def cast_module(self, module: torch.nn.Module) -> None:
        """bf16/fp16 configs train the model in that dtype (DeepSpeed calls module.half()/bfloat16())."""
        if self.model_dtype is not None:
            module.to(self.model_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.comm_dtype or grad_dtype

    def grad_accum_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.accum_dtype or param_dtype

    def global_norm(self, rows: Sequence[torch.Tensor | KnownSquares], *, factor: float, scope: NormScope) -> GradNorm:
        """Global L2 norm of `factor x` the gradients whose pieces this rank counts are `rows` (1-D,
        contiguous; engine/zero/norm_scope.py says which, and over which ranks they add up), or partial
        sums of some taken earlier (KnownSquares, engine/ops/overflow.py: the same norm, bitwise).

        Local sums of squares are summed by one all-reduce over `scope` (never a gather). An inf or
        nan anywhere makes the sum non-finite on every rank, so the same collective is the overflow
        check all ranks agree on.
        """
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

    def step_shards(
        self,
        rows: Sequence[torch.Tensor | KnownSquares],
        update: Callable[[float], None],
        *,
        max_grad_norm: float,
        average: float,
        scope: NormScope,
    ) -> tuple[float, bool]:
        """The shared end of every sharded step: the global norm (one all-reduce, also the overflow
        vote), a skip on an inf/nan norm (the loss scaler's overflow in fp16; in fp32 and bf16 the Engine
        warns or raises NonFiniteGradientError), then `update(coef)` (engine/zero/master_step.py), where coef
        folds averaging, unscaling and clipping (like torch.nn.utils.clip_grad_norm_) into the one
        factor the optimizer step applies to each gradient as it reads it, and the loss-scale update.
        Returns (global norm before clipping, whether the step was applied)."""
        factor = average / self.loss_scale
        norm = self.global_norm(rows, factor=factor, scope=scope)
        if norm.overflow and self.scaler is not None:
            self.scaler.update(overflow=True)
            return norm.norm, False
        if norm.overflow:  # fp32/bf16: the norm is global, so every rank skips together (the Engine says so)
            return norm.norm, False
        coef = factor
        if max_grad_norm > 0 and norm.norm + 1e-6 > max_grad_norm:
            coef *= max_grad_norm / (norm.norm + 1e-6)
        update(coef)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return norm.norm, True
