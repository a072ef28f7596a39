"""The Engine: forward / backward / step with gradient accumulation.

It knows no stage details: it asks a `ZeroStage` (engine/zero/base.py) to prepare and finish each
backward and to take the optimizer step. It owns the LR schedule and the accumulation window
(engine/runtime/window.py: the state, the counters), and hands each step's facts to its reporter
(engine/monitor/reporter.py). Its save and load methods (checkpoints, the 16-bit model, the consolidated
state dict) are SavingMixin's, in engine/runtime/saving.py; DeepSpeed's accessors are AccessorsMixin's;
offload_states / reload_states / empty_partition_cache are StateOffloadMixin's (engine/runtime/state_offload.py);
compile / is_compiled are CompileMixin's (engine/runtime/compile.py).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from engine import activation_checkpointing, comm
from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.monitor.reporter import StepFacts, StepReporter
from engine.monitor.timers import WallClockTimers
from engine.parallel.groups import ParallelGroups
from engine.parallel.same_inputs import check_same_inputs
from engine.precision import NonFiniteGradientError, Precision
from engine.profiling.step_profile import StepProfile
from engine.runtime.accessors import AccessorsMixin
from engine.runtime.auto_cast import to_half
from engine.runtime.compile import CompileMixin
from engine.runtime.saving import SavingMixin
from engine.runtime.state_offload import OffloadedStates, StateOffloadMixin, StatesOffloadedError
from engine.runtime.window import TrainingWindow, WindowState
from engine.runtime.zero_optimizer import ZeroOptimizer
from engine.zero.base import ZeroStage
from engine.zero.released import full_numel

logger = get_logger()

_SPENT_GRAPH = (
    'engine.backward() was called on a loss whose graph an earlier backward() already freed (torch: "Trying to '
    'backward through the graph a second time"); run a new forward for each backward, or pass retain_graph=True '
    "to the earlier engine.backward() if the graph must be backpropagated twice"
)
_SAME_LOSS_AGAIN = (
    "engine.backward() was called twice on the same loss: the earlier backward (retain_graph=True) already "
    "added its gradients, and a second one would count this micro-batch twice (and at stage 3 run through "
    "parameters already partitioned again); nothing was changed. For several losses on one graph, add them "
    "and call engine.backward() once on the sum"
)


class NoOptimizerError(RuntimeError):
    """backward() or step() on an engine built without an optimizer (an evaluation-only engine)."""

    def __init__(self, call: str, stage: int) -> None:
        super().__init__(
            f"engine.{call}() needs an optimizer, and this engine (zero_optimization.stage {stage}) was built "
            'without one: engine.initialize() got no optimizer= and the config has no "optimizer" section, '
            "which makes an evaluation-only engine (forward only, as in DeepSpeed's ZeRO inference). To train, "
            'add an "optimizer" section to the config or pass optimizer= to engine.initialize()'
        )


class DestroyedEngineError(RuntimeError):
    """A call on an engine after destroy() (or Accelerate's free_memory(), which calls it)."""

    def __init__(self) -> None:
        super().__init__(
            "this engine was destroyed (engine.destroy(), or Accelerate's free_memory(), which HF Trainer calls "
            "at the start of every train()); create a new one with engine.initialize(). With HF Trainer at "
            "ZeRO stage 3, trainer.evaluate() before trainer.train() builds an evaluation-only engine that "
            "train() destroys and then reuses (transformers 5.x; DeepSpeed fails there too, with an "
            "AttributeError): train first, or evaluate with a separate Trainer"
        )


class Engine(AccessorsMixin, SavingMixin, StateOffloadMixin, CompileMixin, torch.nn.Module):
    """Wraps a module for data-parallel training; DeepSpeedEngine's user-facing surface. A
    torch.nn.Module as DeepSpeedEngine is (Lightning Fabric finds the engine by scanning
    `module.modules()`; user code checks isinstance(model, nn.Module)), with the model registered as
    its submodule `module`."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: EngineConfig,
        stage: ZeroStage,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        device: torch.device,
        training_dataloader: Any = None,
        precision: Precision | None = None,
        owns_process_group: bool = False,
        parallel: ParallelGroups | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.engine_config = config
        self.config: Mapping[str, Any] = config.raw  # DeepSpeed exposes the user's dict here
        self.basic_optimizer = optimizer
        """The torch optimizer stepping the fp32 masters (DeepSpeed's name); the stage drives it."""
        self.optimizer: ZeroOptimizer | None = ZeroOptimizer(self, optimizer) if optimizer is not None else None
        """What engine.initialize returns (DeepSpeed's ZeRO optimizer): zero_grad() always safe, step() the
        whole ZeRO step; it carries DeepSpeed's `overflow` flag (Accelerate checks it exists when it wraps)."""
        self._warned_empty_step = False
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.device = device
        self._stage: ZeroStage | None = stage
        self._offloaded: OffloadedStates | None = None
        """What offload_states() moved aside (engine/runtime/state_offload.py), None when nothing is."""
        self.precision = precision if precision is not None else Precision(config)
        self._owns_process_group = owns_process_group

        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.world_size = comm.get_world_size()
        self.parallel = parallel or ParallelGroups.data_parallel_only()
        """The tensor- and data-parallel groups (engine/parallel/): ZeRO partitions over the data-parallel one."""
        self._auto_cast = config.fp16.enabled and config.fp16.auto_cast
        """fp16.auto_cast: floating positional inputs are cast to fp16 in forward (engine/runtime/auto_cast.py)."""
        self._inputs_checked = False
        """The first forward's check that a tensor-parallel group's ranks got one batch (same_inputs.py) ran."""

        self._window = TrainingWindow(config.gradient_accumulation_steps)
        """The accumulation window's state and the step counters (engine/runtime/window.py)."""
        self._global_grad_norm: float | None = None
        self._last_backward: tuple[weakref.ref[torch.Tensor], bool] | None = None
        """The last loss backpropagated, and whether its graph was retained: backpropagating it again is
        refused by name before any stage state moves, at every stage (stage 2 summed it in silently,
        stage 3 failed inside torch)."""

        self._timers = WallClockTimers(device) if config.wall_clock_breakdown else None
        self._profile = (
            StepProfile(self, config.flops_profiler, self.precision.model_dtype or torch.float32, device)
            if config.flops_profiler.enabled and self.global_rank == 0
            else None
        )
        self._reporter = StepReporter(config, self.global_rank, comm.comm_stats(), self._timers, self._profile)
        """Monitors, the progress line and the step's comm bytes (engine/monitor/reporter.py)."""

    # ------------------------------------------------------------------------ fall-through
    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: nn.Module's registered submodules (`module`), then
        # the wrapped module's attributes, as with DeepSpeedEngine (engine.config_class, engine.generate).
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(module, name)

    # ---------------------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_alive()
        if self._auto_cast:
            args = to_half(args)
        if not self._inputs_checked:
            if self.parallel.tp_size > 1:
                check_same_inputs(args, kwargs, self.parallel)
            self._inputs_checked = True
        if self._timers:
            self._timers.start("forward")
        if self._profile is not None:
            self._profile.before_forward(self.global_steps, self._window.first_micro_step())
        try:
            out = self.module(*args, **kwargs)
        finally:
            if self._profile is not None:
                self._profile.after_forward()
        if self._timers:
            self._timers.stop("forward")
        activation_checkpointing.after_forward()  # number_checkpoints too small: named, before any gradient moves
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss`, divided by gradient_accumulation_steps (as DeepSpeed does) unless
        scale_wrt_gas=False. At an accumulation boundary gradient reduction overlaps backward."""
        stage = self._require_alive()
        if self.optimizer is None:
            raise NoOptimizerError("backward", self.zero_optimization_stage())
        user_loss = loss
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(
                f"engine.backward() needs a scalar loss tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}"
            )
        # Checked before any stage state moves: the same error at every stage, and the step can go on.
        if self._last_backward is not None and self._last_backward[0]() is loss:
            raise RuntimeError(_SAME_LOSS_AGAIN if self._last_backward[1] else _SPENT_GRAPH)
        unscaled = loss.detach()
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self._timers:
            self._timers.start("backward")
        if self._profile is not None:
            self._profile.before_backward()
        stage.prepare_backward(boundary=self.is_gradient_accumulation_boundary(), sync=not self._window.unsynced)
        try:
            with self._backward_compiled():
                self.precision.scale_loss(loss).backward(retain_graph=retain_graph)
        except RuntimeError as err:
            if "backward through the graph a second time" in str(err):  # a new tensor computed from a spent one
                raise RuntimeError(_SPENT_GRAPH) from err
            raise
        stage.finish_backward()
        if self._profile is not None:
            self._profile.after_backward()
        if self._timers:
            self._timers.stop("backward")
        self._last_backward = (weakref.ref(user_loss), retain_graph)
        self._window.add_backward(unscaled)
        return loss

    def step(self) -> None:
        """Call after every micro-batch; acts at accumulation boundaries: clip, optimizer step,
        zero gradients, LR schedule, counters, logs."""
        stage = self._require_alive()
        if self.optimizer is None:
            raise NoOptimizerError("step", self.zero_optimization_stage())
        if self._window.unsynced:
            raise RuntimeError(
                "engine.step() inside engine.no_sync(): gradients there are not reduced "
                "across ranks; leave the no_sync() block before calling step()"
            )
        self._window.last_step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step(stage)
        self._window.end_micro_step()

    def step_from_optimizer(self) -> None:
        """optimizer.step() on the optimizer initialize returned (Lightning Fabric's loop): the boundary
        step now, wherever the window is; the next micro-step starts a new window."""
        stage = self._require_alive()
        if self._window.unsynced:
            raise RuntimeError(
                "optimizer.step() inside engine.no_sync(): gradients there are not reduced "
                "across ranks; leave the no_sync() block before stepping"
            )
        if self._window.state is WindowState.EMPTY:
            # engine.step() already took this window's step (a loop calling both), or no backward ran:
            # a second update from zero gradients would still move Adam's weights.
            if not self._warned_empty_step and self.global_rank == 0:
                logger.warning(
                    "optimizer.step() with no engine.backward() since the last optimizer step (a loop "
                    "that also calls engine.step(), or no backward yet): nothing to step, skipped. "
                    "Call one of engine.step() or optimizer.step() per step (said once)"
                )
                self._warned_empty_step = True
            return
        self._window.last_step_applied = False
        self._optimizer_step(stage)
        self._window.restart()

    def _optimizer_step(self, stage: ZeroStage) -> None:
        """The step at an accumulation boundary: clip, update, zero gradients, LR schedule, counters, logs."""
        assert self.optimizer is not None
        window = self._window
        with window.stepping():
            if self._timers:
                self._timers.start("step")
            step_started = time.perf_counter() if self._profile is not None else 0.0
            outcome = stage.step(self.engine_config.gradient_clipping)
            if not outcome.applied and self.precision.scaler is None:
                self._non_finite_step(outcome.grad_norm)  # fp32/bf16: an inf/nan norm skipped the step
            if self._profile is not None:
                self._profile.after_step(time.perf_counter() - step_started, self.gradient_accumulation_steps())
            self._global_grad_norm = outcome.grad_norm
            # DeepSpeed: a skipped (overflowed) step does not advance the LR schedule, but counts.
            if outcome.applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if not outcome.applied:
                window.skipped_steps += 1
            if self._timers:
                self._timers.stop("step")
            window.last_step_applied = outcome.applied
            self.optimizer.overflow = not outcome.applied
            if outcome.applied:  # a schedule built on the returned optimizer sees the step engine.step() took
                vars(self.optimizer)["_opt_called"] = True
            window.global_steps += 1
            window.global_samples += self.train_batch_size()
        assert window.last_loss is not None  # the window just stepped
        scaler = self.precision.scaler
        self._reporter.after_step(
            StepFacts(
                global_steps=window.global_steps,
                global_samples=window.global_samples,
                samples=self.train_batch_size(),
                loss=window.last_loss,
                lrs=self.get_lr(),
                grad_norm=self._global_grad_norm,
                loss_scale=scaler.scale if scaler is not None else None,
                skipped_steps=window.skipped_steps,
                comm=comm.comm_stats(),
                memory=self.memory_report,
                trainable_numel=self._trainable_numel,
            )
        )

    def _non_finite_step(self, norm: float) -> None:
        """An fp32/bf16 step whose global norm was inf/nan: the stage updated nothing and dropped its gradients
        (applying it would write NaN into every weight). Stop (check_for_nan_in_loss_and_grad), with the window
        started again so the step can be rerun, or say on rank 0 that it is skipped. Every rank sees the same
        all-reduced norm, so every rank takes the same branch."""
        if self.engine_config.check_for_nan_in_loss_and_grad:
            self._window.drop()
            if self._timers:
                self._timers.stop("step")
            raise NonFiniteGradientError(self.global_steps + 1, norm, self.global_rank)
        if self.global_rank == 0:
            logger.warning(
                "step %d: gradient norm is %s (non-finite loss or gradients); the step was skipped: weights and "
                "optimizer state are unchanged and the LR schedule did not advance, skipped_steps %d. Set "
                '"check_for_nan_in_loss_and_grad": true to stop training at such a step instead',
                self.global_steps + 1,
                norm,
                self._window.skipped_steps + 1,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last optimizer step (start the window again).
        The optimizer's zero_grad() never does this (engine/runtime/zero_optimizer.py)."""
        self._require_alive().zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communication; the next
        reduction (a boundary backward outside the block, or step()) averages the sum."""
        with self._window.no_sync():
            yield

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._window.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the current micro-step (frameworks that manage accumulation)."""
        self._window.boundary_override = is_boundary

    # DeepSpeedEngine's counters, kept by the window (a checkpoint's load sets the first three).
    @property
    def micro_steps(self) -> int:
        return self._window.micro_steps

    @property
    def global_steps(self) -> int:
        return self._window.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self._window.global_steps = value

    @property
    def global_samples(self) -> int:
        return self._window.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self._window.global_samples = value

    @property
    def skipped_steps(self) -> int:
        return self._window.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._window.skipped_steps = value

    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank per category: the model states (params, master, gradients,
        optimizer_state; `python -m engine.estimate` predicts them) and the stage's buffers; with NVMe
        offload, "nvme": the bytes in this rank's swap files."""
        return self._require_alive().memory_report()

    def _trainable_numel(self) -> int:
        """Psi: elements of the trainable parameters (whole ones, also when stage 3 holds them empty)."""
        return sum(full_numel(p) for p in self.module.parameters() if p.requires_grad)

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank sent and calls made per collective type: cumulative ("bytes_sent",
        "calls") and for the last optimizer step ("last_step": the same two dicts)."""
        return {**comm.comm_stats(), "last_step": self._reporter.last_step_comm}

    # ------------------------------------------------------------------------------ teardown
    def _live_stage(self) -> ZeroStage:
        if self._window.destroyed:
            raise DestroyedEngineError()
        assert self._stage is not None  # dropped only by destroy(), which moved the window to DESTROYED
        return self._stage

    def _require_alive(self) -> ZeroStage:
        """The stage, for a call that reads the training states: refused while they are offloaded."""
        stage = self._live_stage()
        if self._offloaded is not None and self._offloaded.moved:
            kinds = ", ".join(k.value for k in self._offloaded.kinds)
            raise StatesOffloadedError(
                f"the engine's states ({kinds}) are on {self._offloaded.device.value}, moved by offload_states(): "
                "call engine.reload_states() first"
            )
        return stage

    def destroy(self) -> None:
        """Release hooks, gradient buffers, optimizer state, monitors and the process group this
        engine created. Idempotent."""
        if self._window.destroyed:
            return
        self.reload_states()  # states set aside come back first: the module is given back whole
        self._require_alive().destroy()  # stage 3 gathers every unit back into the module first (not from NVMe: see there)
        self._window.destroy()
        self._stage = None  # the stage's memory goes with it
        if self.basic_optimizer is not None:
            self.basic_optimizer.state.clear()
        self._reporter.close()
        self.training_dataloader = None
        if self._owns_process_group:
            comm.release_process_group()
            self._owns_process_group = False
