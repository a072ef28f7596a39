"""Mixed precision shared by every stage: the model's dtype, the wire and accumulation dtypes, and loss
scaling. It answers precision questions only; the step that uses them (the global norm, the vote on
an inf/nan norm, clipping) is engine/zero/shard_step.py's.

bf16 and fp16 configs cast the model to that dtype; the stages keep an fp32 master copy for every
flat group whose dtype is not fp32 (fp32 groups need none: the optimizer updates them in place).
fp16 scales the loss (engine/precision/loss_scaler.py); an overflow anywhere skips the step on every rank.
fp32 and bf16 skip the same way when the global gradient norm is inf/nan (a NaN or inf loss on any
rank would otherwise write NaN into every weight), with a warning, or stop with NonFiniteGradientError
when the config sets check_for_nan_in_loss_and_grad.
"""

from __future__ import annotations

import torch

from engine.config.types import EngineConfig
from engine.precision.loss_scaler import LossScaler

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

    def after_step(self, *, overflow: bool) -> None:
        """The loss scale follows a step's outcome (fp16's dynamic scaling: down on an overflow, up after
        a clean window); nothing to do without a scaler."""
        if self.scaler is not None:
            self.scaler.update(overflow=overflow)
