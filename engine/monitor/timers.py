"""Wall-clock timers for `wall_clock_breakdown` (forward / backward / step)."""

from __future__ import annotations

import time

import torch


class WallClockTimers:
    """Accumulates milliseconds per phase between reports; synchronises CUDA so times are real."""

    def __init__(self, device: torch.device) -> None:
        self._sync = device.type == "cuda"
        self._started: dict[str, float] = {}
        self._total_ms: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._step_ms: dict[str, float] = {}  # this optimizer step's, summed over its micro-steps

    def start(self, name: str) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self._sync:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - self._started.pop(name)) * 1000.0
        self._total_ms[name] = self._total_ms.get(name, 0.0) + elapsed
        self._count[name] = self._count.get(name, 0) + 1
        self._step_ms[name] = self._step_ms.get(name, 0.0) + elapsed

    def take_step(self) -> dict[str, float]:
        """Milliseconds per phase since the last call (one optimizer step's), then reset: DeepSpeed's
        Train/Samples/elapsed_time_ms_<phase> events."""
        taken, self._step_ms = self._step_ms, {}
        return taken

    def report(self) -> str:
        """Mean ms per call since the last report, then reset."""
        parts = [f"{name}: {self._total_ms[name] / self._count[name]:.2f}" for name in self._total_ms]
        self._total_ms.clear()
        self._count.clear()
        return "time (ms) | " + " | ".join(parts)
