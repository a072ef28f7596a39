"""What the Engine tells after each optimizer step, in one place: the monitors' events (rank 0), the
progress line every `steps_per_print` steps (loss, learning rates, gradient norm, samples/s, TFLOPs and
MFU once the flops profiler measured a step, skipped steps), the wall-clock breakdown, the memory line,
and the bytes the step's collectives sent.

The Engine hands each step's facts over as values (StepFacts): this module computes nothing about
training, and reads the process group's counters only as the dicts the Engine passes in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.config.types import EngineConfig
from engine.monitor.events import StepRecord, achieved, step_events
from engine.monitor.log import get_logger
from engine.monitor.memory import memory_line
from engine.monitor.monitors import Monitors
from engine.monitor.timers import WallClockTimers

logger = get_logger()

CommStats = Mapping[str, Mapping[str, int]]
"""engine.comm.comm_stats(): {"bytes_sent": {op: bytes}, "calls": {op: count}}, cumulative."""


class FlopsSource(Protocol):
    """What the flops profiler knows once it measured a step (engine/profiling/step_profile.py)."""

    flops_per_step: float | None
    peak_flops: float | None


@dataclass(frozen=True)
class StepFacts:
    """One optimizer step as the Engine knows it when the step has ended."""

    global_steps: int
    global_samples: int
    samples: int
    """Samples in the step (train_batch_size)."""
    loss: float
    """Mean unscaled loss of the step's micro-batches on this rank."""
    lrs: list[float]
    grad_norm: float | None
    loss_scale: float | None
    skipped_steps: int
    comm: CommStats
    """comm_stats() now (cumulative); the reporter keeps the difference from the last step's."""
    memory: Callable[[], Mapping[str, int]]
    """engine.memory_report(), asked only when a monitor or the memory line needs it."""
    trainable_numel: Callable[[], int]


class StepReporter:
    """The reports of one engine (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        comm_at_start: CommStats,
        timers: WallClockTimers | None,
        profile: FlopsSource | None,
    ) -> None:
        self._config = config
        self._rank = rank
        self._timers = timers
        self._profile = profile
        # Rank 0 writes the monitors, as DeepSpeed's; the packages were checked at initialize.
        self._monitors = Monitors(config) if rank == 0 else None
        self._comm_at_step = comm_at_start
        self.last_step_comm: dict[str, dict[str, int]] = {"bytes_sent": {}, "calls": {}}
        """Bytes sent and calls made per collective type in the last optimizer step."""
        self._window_started = time.perf_counter()
        """perf_counter() when the progress line's rate window started."""
        self._window_steps = 0
        """Optimizer steps in the rate window."""
        self._rate_warm = False
        """The first optimizer step of this engine ended: the progress line's samples/s counts from there."""
        self._step_ended: float | None = None
        """perf_counter() when the last optimizer step ended: the next step's wall time starts there."""

    def after_step(self, facts: StepFacts) -> None:
        self._record_comm(facts.comm)
        self._window_steps += 1
        now = time.perf_counter()
        if self._monitors:
            self._monitors.write_events(step_events(self._record(facts, now)))
        self._step_ended = now
        every = self._config.steps_per_print
        if every and facts.global_steps % every == 0:
            if self._rank == 0:
                self._progress_line(facts)
            self._restart_rate()
        if not self._rate_warm:
            # The first step pays one-time costs (the C++ extension's first build, first-touch allocations,
            # stage 3's trace): a rate counting it understated a 66 samples/s run as 9.1 at step 50.
            self._rate_warm = True
            self._restart_rate()

    def close(self) -> None:
        if self._monitors is not None:
            self._monitors.close()

    # ----------------------------------------------------------------------------------- parts
    def _record(self, facts: StepFacts, now: float) -> StepRecord:
        profile = self._profile
        return StepRecord(
            global_samples=facts.global_samples,
            loss=facts.loss,
            lr=facts.lrs[0],
            loss_scale=facts.loss_scale,
            grad_norm=facts.grad_norm,
            samples=facts.samples,
            seconds=now - self._step_ended if self._step_ended is not None else None,
            flops=profile.flops_per_step if profile else None,
            peak_flops=profile.peak_flops if profile else None,
            comm_bytes=sum(self.last_step_comm["bytes_sent"].values()),
            memory=facts.memory(),
            phase_ms=self._timers.take_step() if self._timers else {},
        )

    def _progress_line(self, facts: StepFacts) -> None:
        elapsed = time.perf_counter() - self._window_started
        rate = self._window_steps * facts.samples / max(elapsed, 1e-9)
        lr = ", ".join(f"{x:.3e}" for x in facts.lrs)
        logger.info(
            "step %d | loss %.4f | lr [%s] | grad norm %.3f | %.1f samples/s%s | skipped %d",
            facts.global_steps,
            facts.loss,
            lr,
            facts.grad_norm or 0.0,
            rate,
            self._flops_text(elapsed / max(self._window_steps, 1)),
            facts.skipped_steps,
        )
        if self._timers:
            logger.info(self._timers.report())
        if self._config.memory_breakdown:
            logger.info(memory_line(dict(facts.memory()), facts.trainable_numel(), self._rank))
        if self._config.comms_logger:
            sent, calls = self.last_step_comm["bytes_sent"], self.last_step_comm["calls"]
            logger.info(
                "comm last step: %s",
                ", ".join(f"{op} {sent.get(op, 0) / 2**20:.2f} MiB in {calls[op]} calls" for op in sorted(calls))
                or "nothing sent",
            )

    def _restart_rate(self) -> None:
        self._window_started = time.perf_counter()
        self._window_steps = 0

    def _flops_text(self, step_seconds: float) -> str:
        """ " | 0.063 TFLOPs/rank (MFU 68.2% of 0.09)" once the flops profiler measured a step; else nothing."""
        if self._profile is None or not self._profile.flops_per_step:
            return ""
        peak = self._profile.peak_flops
        rate, mfu = achieved(self._profile.flops_per_step, step_seconds, peak)
        share = f" (MFU {mfu:.1%} of {peak / 1e12:.2f})" if mfu is not None and peak else ""
        return f" | {rate / 1e12:.3f} TFLOPs/rank{share}"

    def _record_comm(self, now: CommStats) -> None:
        before = self._comm_at_step
        self.last_step_comm = {
            kind: {op: n - before[kind].get(op, 0) for op, n in now[kind].items() if n - before[kind].get(op, 0)}
            for kind in ("bytes_sent", "calls")
        }
        self._comm_at_step = now
