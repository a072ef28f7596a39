"""The interface every ZeRO stage implements; the Engine calls only these methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float
    """Global gradient norm before clipping (unscaled; inf/nan when fp16 overflowed)."""
    applied: bool
    """False when the step was skipped (fp16 overflow on any rank)."""


class ZeroStage(Protocol):
    """One data-parallel strategy. The Engine never branches on the stage number beyond choosing it."""

    optimizer: torch.optim.Optimizer

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        """Called before each backward: is this micro-step an accumulation boundary, and may it
        communicate (False inside engine.no_sync())?"""

    def finish_backward(self) -> None:
        """Called after each backward returns: complete whatever communication it started."""

    def step(self, max_grad_norm: float) -> StepOutcome:
        """At an accumulation boundary: finish gradient reduction, clip to max_grad_norm (0: off),
        step the optimizer (unless fp16 overflowed), zero the gradients."""

    def zero_grad(self) -> None:
        """Zero the accumulated gradients (keeps their storage)."""

    def memory_report(self) -> dict[str, int]:
        """Bytes held by this stage per buffer kind, for logs and benchmarks."""

    def state_dict(self) -> dict[str, Any]:
        """The stage's own state beyond the optimizer's (nothing for stage 0)."""

    def destroy(self) -> None:
        """Remove hooks and release every buffer the stage allocated."""
