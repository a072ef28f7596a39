"""The Engine's save and load methods, DeepSpeedEngine's names: sharded checkpoints (engine/checkpoint/),
the whole model's 16-bit state dict (save_16bit_model, HF's stage-3 save) and the consolidated state dict.

A mixin of engine.runtime.engine.Engine, kept apart from the training loop it does not touch: what it reads of
the Engine is declared below, and a checkpoint sees the Engine only as the TrainingState it builds.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from engine.checkpoint import restore, store
from engine.checkpoint.atomic_file import atomic_save
from engine.checkpoint.training_state import Counters, TrainingState
from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.parallel.groups import ParallelGroups
from engine.precision import Precision

if TYPE_CHECKING:
    from engine.runtime.window import TrainingWindow
    from engine.zero.base import ZeroStage

logger = get_logger()


class SavingMixin:
    """Engine methods that save and load its state (see the module docstring)."""

    # What the methods read of the Engine (set by Engine.__init__).
    module: torch.nn.Module
    engine_config: EngineConfig
    basic_optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    precision: Precision
    parallel: ParallelGroups
    global_rank: int
    _window: TrainingWindow

    if TYPE_CHECKING:  # the Engine's own methods, declared for the type checker only (the Engine's stay in the MRO)

        def _require_alive(self) -> ZeroStage: ...

        def zero_optimization_stage(self) -> int: ...

        def gradient_accumulation_steps(self) -> int: ...

    def consolidated_state_dict(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The model's full state dict on rank 0 ({} on other ranks), copied to `device` (None: where
        each tensor lives); every rank must call it. At stage 3 it is gathered one unit at a time (never
        the whole model on every rank). Tied weights stay one tensor under each name."""
        return self._require_alive().consolidated_state_dict(device)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's zero_optimization.stage3_gather_16bit_weights_on_model_save (False when absent):
        whether a stage-3 model save gathers the whole model (HF/Accelerate ask before saving)."""
        return bool(self.engine_config.zero.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's stage-3 full state dict, as HF Trainer and Accelerate save it: on rank 0 every
        parameter (in the training dtype) and persistent buffer on the CPU, tied weights one tensor
        under each name, frozen parameters left out on request; None on the other ranks, as in
        DeepSpeed. Every rank must call it. Gathered one unit at a time whatever
        stage3_gather_16bit_weights_on_model_save says (that flag is for the callers to check)."""
        self._require_alive()
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                f"engine._zero3_consolidated_16bit_state_dict() needs zero_optimization.stage 3, this "
                f"engine runs stage {self.zero_optimization_stage()} (every rank holds the whole model): "
                "use engine.module.state_dict() or engine.consolidated_state_dict()"
            )
        state = self.consolidated_state_dict(torch.device("cpu"))
        if self.global_rank != 0:
            return None
        return self._without_frozen(state) if exclude_frozen_parameters else state

    def _without_frozen(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # remove_duplicate=False: a tied parameter's every name, not only its first.
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in state.items() if k not in frozen}

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's save_16bit_model: the whole model's state dict in the training dtype, written by
        rank 0 to save_dir/save_filename (torch.save, atomically: a temporary file fsynced and renamed).
        Every rank must call it. At stage 3 it needs zero_optimization.
        stage3_gather_16bit_weights_on_model_save (then gathered one unit at a time); without it
        nothing is saved and False is returned, as in DeepSpeed."""
        self._require_alive()
        if self.zero_optimization_stage() == 3 and not self.zero_gather_16bit_weights_on_model_save():
            logger.warning(
                'save_16bit_model: nothing saved; at stage 3 it needs "zero_optimization": '
                '{"stage3_gather_16bit_weights_on_model_save": true} (or use '
                "engine.consolidated_state_dict())"
            )
            return False
        state = self.consolidated_state_dict()
        if exclude_frozen_parameters:
            state = self._without_frozen(state)
        if self.global_rank == 0:
            atomic_save(state, os.path.join(save_dir, save_filename))
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """DeepSpeed's save_checkpoint: every rank writes its own shard files into save_dir/tag
        (default tag global_step<N>), the tag appears complete or not at all, then `latest` names it.
        exclude_frozen_parameters leaves the values of requires_grad=False parameters out (loading then
        needs load_module_strict=False and keeps the model's own). Every rank must call it. Returns the
        tag directory. See engine/checkpoint/."""
        state = self._training_state()
        with _resident(state.stage):  # an NVMe run's swapped state, for the save's duration
            return store.save(state, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """DeepSpeed's load_checkpoint -> (checkpoint path, client_state). tag None reads `latest`.
        Loads at any world size and ZeRO stage: every piece is found by parameter name and offset."""
        state = self._training_state()
        with _resident(state.stage):  # loaded into memory, then written to the swap files
            loaded = restore.load(
                state,
                load_dir,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
            )
        if loaded.counters is not None:
            window = self._window
            window.global_steps = loaded.counters.global_steps
            window.global_samples = loaded.counters.global_samples
            window.skipped_steps = loaded.counters.skipped_steps
            # A checkpoint holds no partly accumulated gradients, and this run's gradient_accumulation_steps
            # may differ from the saving run's: resume at the start of an accumulation window, as DeepSpeed
            # does (it does not restore micro_steps), with micro_steps consistent with global_steps.
            window.restart()
            if window.micro_steps != loaded.counters.micro_steps and self.global_rank == 0:
                logger.info(
                    "resumed at step %d at the start of an accumulation window of %d micro-steps "
                    "(micro_steps %d; the checkpoint had %d: saved inside a window, or with another "
                    "gradient_accumulation_steps; partial windows are not saved)",
                    window.global_steps,
                    self.gradient_accumulation_steps(),
                    window.micro_steps,
                    loaded.counters.micro_steps,
                )
        return loaded.path, loaded.client_state

    def _training_state(self) -> TrainingState:
        """What a checkpoint saves from and loads into (engine/checkpoint/training_state.py)."""
        stage = self._require_alive()
        return TrainingState(
            module=self.module,
            optimizer=self.basic_optimizer,
            lr_scheduler=self.lr_scheduler,
            loss_scaler=self.precision.scaler,
            stage=stage,
            model_dtype=self.precision.model_dtype,
            counters=Counters(
                global_steps=self._window.global_steps,
                global_samples=self._window.global_samples,
                skipped_steps=self._window.skipped_steps,
                micro_steps=self._window.micro_steps,
            ),
            parallel=self.parallel,
        )


def _resident(stage: ZeroStage) -> contextlib.AbstractContextManager[None]:
    """The stage's whole optimizer state in memory for the duration (a checkpoint's save or load): its
    offload tier's swapped state read in and written back after; nothing to do without one."""
    return stage.offload.resident() if stage.offload is not None else contextlib.nullcontext()
