"""The events an optimizer step writes to the monitors: DeepSpeed's names, then the engine's own.

DeepSpeed's (engine.py, _take_model_step): Train/Samples/train_loss, Train/Samples/lr and, in fp16,
Train/Samples/loss_scale, all at step = global_samples. Added here: the global gradient norm
(grad_norm), DeepSpeed's elapsed_time_ms_<phase> with wall_clock_breakdown (forward, backward, step
summed over the step's micro-steps), this step's throughput (samples_per_sec), achieved TFLOPs and model-flops utilisation
when the flops profiler has measured the model (tflops, mfu), the bytes this rank sent in the step's
collectives (comm_bytes) and rank 0's memory per category (memory/<category>, bytes, as
engine.memory_report()).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

Event = tuple[str, float, int]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step produced, as the engine knows it."""

    global_samples: int
    loss: float
    lr: float
    loss_scale: float | None
    grad_norm: float | None
    samples: int
    """Samples in the step (train_batch_size)."""
    seconds: float | None
    """Wall time since the previous optimizer step ended (None for the first step)."""
    flops: float | None
    """Floating-point operations of one step on this rank (flops profiler), None before it measured."""
    peak_flops: float | None
    """FLOP/s this rank can reach (engine.profiling.measured_peak_flops)."""
    comm_bytes: int
    memory: Mapping[str, int]
    phase_ms: Mapping[str, float]
    """wall_clock_breakdown: milliseconds of forward, backward and step in this optimizer step."""


def achieved(flops: float, seconds: float, peak_flops: float | None) -> tuple[float, float | None]:
    """(FLOP/s achieved, model-flops utilisation against `peak_flops`, None without a peak)."""
    rate = flops / max(seconds, 1e-9)
    return rate, (rate / peak_flops if peak_flops else None)


def step_events(record: StepRecord) -> list[Event]:
    at = record.global_samples
    events: list[Event] = [("Train/Samples/train_loss", record.loss, at), ("Train/Samples/lr", record.lr, at)]
    if record.loss_scale is not None:
        events.append(("Train/Samples/loss_scale", record.loss_scale, at))
    if record.grad_norm is not None:
        events.append(("Train/Samples/grad_norm", record.grad_norm, at))
    if record.seconds:
        events.append(("Train/Samples/samples_per_sec", record.samples / record.seconds, at))
        if record.flops:
            rate, mfu = achieved(record.flops, record.seconds, record.peak_flops)
            events.append(("Train/Samples/tflops", rate / 1e12, at))
            if mfu is not None:
                events.append(("Train/Samples/mfu", mfu, at))
    events += [(f"Train/Samples/elapsed_time_ms_{phase}", ms, at) for phase, ms in record.phase_ms.items()]
    events.append(("Train/Samples/comm_bytes", float(record.comm_bytes), at))
    events += [(f"Train/Samples/memory/{name}", float(value), at) for name, value in record.memory.items()]
    return events
