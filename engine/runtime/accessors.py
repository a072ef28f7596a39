"""The Engine's read-only accessors under DeepSpeedEngine's names (batch sizes, stage, precision flags,
learning rates, the last step's norm and loss, the parallel sizes), which HF Trainer, Accelerate, Lightning
and users' loops call. A mixin of engine.runtime.engine.Engine: what it reads of the Engine is declared below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.comm import ProcessGroup
from engine.config.types import EngineConfig
from engine.parallel.groups import ParallelGroups

if TYPE_CHECKING:
    from engine.runtime.window import TrainingWindow
    from engine.runtime.zero_optimizer import ZeroOptimizer


class AccessorsMixin:
    """DeepSpeedEngine's accessor methods (see the module docstring)."""

    # What the methods read of the Engine (set by Engine.__init__ and its steps).
    engine_config: EngineConfig
    parallel: ParallelGroups
    optimizer: ZeroOptimizer | None
    _global_grad_norm: float | None
    _window: TrainingWindow

    @property
    def dp_world_size(self) -> int:
        """DeepSpeedEngine's name: ranks in this rank's data-parallel group."""
        return self.parallel.dp_size

    @property
    def sequence_parallel_size(self) -> int:
        """DeepSpeedEngine's name: ranks splitting each sample's tokens (1: no sequence parallelism)."""
        return self.parallel.sp_size

    @property
    def seq_parallel_group(self) -> ProcessGroup | None:
        """DeepSpeedEngine's name: this rank's sequence-parallel group (None without one)."""
        return self.parallel.sp_group

    def get_sequence_parallel_group(self) -> ProcessGroup | None:
        return self.parallel.sp_group

    @property
    def mp_world_size(self) -> int:
        """DeepSpeedEngine's name: ranks in this rank's tensor-parallel group."""
        return self.parallel.tp_size

    def train_batch_size(self) -> int:
        return self.engine_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine_config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine_config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.engine_config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.engine_config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine_config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.engine_config.gradient_clipping

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list[Any]:
        if not self.optimizer:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm before clipping at the last optimizer step (None before the first)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._window.last_step_applied

    def get_loss(self) -> float | None:
        """Mean unscaled loss of the last accumulation window on this rank."""
        return self._window.last_loss
