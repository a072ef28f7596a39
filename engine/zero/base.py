"""The interface every ZeRO stage implements: the Engine and the checkpoint store call only these.

`ZeroStage` is what a stage is to its callers. `MasterOwner` is what `engine.zero.GatheredParameters`
needs from a flat stage (0-2) that keeps fp32 masters of whole parameters; stage 3 registers a
`UnitHandle` per parameter instead (engine/zero/owners.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.offload.optimizer_swap import OptimizerSwap
from engine.zero.offload_states import OffloadStateTypeEnum
from engine.zero.records import ShardRecord


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float
    """Global gradient norm before clipping (unscaled; inf/nan when the step was skipped)."""
    applied: bool
    """False when the step was skipped: an inf/nan gradient on any rank (fp16's overflow, or a NaN/inf
    loss or gradient in fp32/bf16; engine/zero/shard_step.py)."""


class ZeroStage(Protocol):
    """One data-parallel strategy. The Engine never branches on the stage number beyond choosing it."""

    stage: int
    """zero_optimization.stage this object implements (0-3)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """None for an evaluation-only engine (the Engine refuses backward and step before they get here)."""

    @property
    def offload(self) -> OptimizerSwap | None:
        """The stage's offload tier: the NVMe swap of its optimizer state (engine/offload/), or None when
        everything is in memory. A checkpoint's save or load holds `offload.resident()` around it; the
        stage itself finishes and closes it in destroy() and counts its files in memory_report()["nvme"]."""

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        """Called before each backward: is this micro-step an accumulation boundary, and may it
        communicate (False inside engine.no_sync())?"""

    def finish_backward(self) -> None:
        """Called after each backward returns: complete whatever communication it started."""

    def step(self, max_grad_norm: float) -> StepOutcome:
        """At an accumulation boundary: finish gradient reduction, clip to max_grad_norm (0: off),
        step the optimizer (unless the global norm is inf/nan: then nothing is updated), zero the
        gradients."""

    def zero_grad(self) -> None:
        """Zero the accumulated gradients (start a new accumulation window)."""

    def memory_report(self) -> dict[str, int]:
        """Bytes held by this stage per buffer kind, for logs and benchmarks; with an offload tier, "nvme":
        the bytes in this rank's swap files."""

    def resident_states(self) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
        """The tensors behind each kind of state engine.offload_states moves (engine/zero/offload_states.py);
        contiguous_grad_buffer is release_scratch's."""

    def release_scratch(self) -> None:
        """Drop the reusable gradient bucket buffers not in use (made again when a backward needs them)."""

    def checkpoint_shards(self) -> list[ShardRecord]:
        """What this rank saves and loads: its fp32 masters (with their optimizer state) and frozen
        shards, as named pieces (engine/zero/records.py)."""

    def consolidated_state_dict(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        """The module's full state dict on rank 0 ({} elsewhere), copied to `device` (None: where each
        tensor lives). Every rank must call it."""

    def destroy(self) -> None:
        """Remove hooks and release every buffer the stage allocated; the module keeps whole parameters.
        An offload tier is finished first (a step still running behind the forward: its error is raised
        here) and closed last (its swap files and folder removed)."""


class MasterOwner(Protocol):
    """A stage that keeps fp32 masters of whole parameters (the flat stages 0-2)."""

    def refresh_masters(self) -> None:
        """The parameters were changed by the user, identically on every rank: copy them into the masters."""
