"""The `flops_profiler` config section at work in an Engine, with DeepSpeed's semantics.

On rank 0, the forward of the first micro-step of the optimizer step at which global_steps equals
`profile_step` is profiled (engine.profiling.FlopsProfiler); its backward and that optimizer step
are timed; when the step ends, DeepSpeed's report is printed (or written to `output_file`). From
then on the engine knows the flops of one optimizer step on this rank, forward flops x (3 +
recompute_fwd_factor) x micro-steps per step (the backward costs twice the forward, as DeepSpeed
counts it), and the progress log and the monitors' tflops/mfu events report achieved TFLOPs and
model-flops utilisation against this process's measured matmul peak (engine.profiling.peak).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.config.types import FlopsProfilerConfig
from engine.profiling.flops_profiler import FlopsProfiler
from engine.profiling.peak import measured_peak_flops


class StepProfile:
    def __init__(self, engine: Any, config: FlopsProfilerConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._engine = engine
        self._config = config
        self._dtype, self._device = dtype, device
        self._profiler = FlopsProfiler(
            engine.module, ds_engine=engine, recompute_fwd_factor=config.recompute_fwd_factor
        )
        self._phase = "waiting"  # -> forward -> backward -> step -> done
        self._backward_started = 0.0
        self.flops_per_step: float | None = None
        """Floating-point operations of one optimizer step on this rank, once profiled."""
        self.peak_flops: float | None = None
        """FLOP/s this process reaches on a square matmul in the compute dtype (measured once, then)."""

    def before_forward(self, global_steps: int, first_micro_step: bool) -> None:
        """An evaluation forward (no grad) at that step is not the training step's: it is skipped."""
        if (
            self._phase == "waiting"
            and global_steps == self._config.profile_step
            and first_micro_step
            and torch.is_grad_enabled()
        ):
            self._profiler.start_profile()
            self._phase = "forward"

    def after_forward(self) -> None:
        """Also on a forward that raised: the counting mode must not outlive it."""
        if self._phase == "forward":
            self._profiler.stop_profile()
            self._phase = "backward"

    def before_backward(self) -> None:
        if self._phase == "backward":
            self._backward_started = time.perf_counter()

    def after_backward(self) -> None:
        if self._phase == "backward" and self._backward_started:
            self._profiler.timings["bwd"] = time.perf_counter() - self._backward_started
            self._phase = "step"

    def after_step(self, step_seconds: float, micro_steps_per_step: int) -> None:
        """At the accumulation boundary of the profiled step: print the report, keep the flops."""
        if self._phase != "step":
            return
        self._phase = "done"
        self._profiler.timings["step"] = step_seconds
        config = self._config
        self._profiler.print_model_profile(
            profile_step=config.profile_step,
            module_depth=config.module_depth,
            top_modules=config.top_modules,
            detailed=config.detailed,
            output_file=config.output_file,
        )
        forward = float(self._profiler.get_total_flops())
        self.flops_per_step = forward * (3 + config.recompute_fwd_factor) * micro_steps_per_step
        self.peak_flops = measured_peak_flops(self._dtype, str(self._device))
        self._profiler.end_profile()
