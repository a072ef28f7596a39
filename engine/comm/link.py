"""What a collective costs on this group, measured once: a fixed latency plus bytes over a bandwidth.

engine/zero/flat/bucket_sizes.py turns the measurement into bucket sizes; this module only measures,
and says when a measurement cannot be trusted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine.comm.collectives import ReduceOp, all_reduce, free_buffers, reduce_scatter
from engine.comm.lifecycle import get_world_size
from engine.comm.state import STATE


@dataclass(frozen=True)
class LinkSpeed:
    """What one collective costs on this group: a fixed latency plus bytes over a bandwidth."""

    latency_s: float
    bandwidth_Bps: float
    """Bytes per second one rank moves in a reduce-scatter (its (N-1)/N share over the time)."""
    rejected: str | None = None
    """Why the measurement cannot be trusted (then the bucket sizes use their fallback), or None."""

    @classmethod
    def from_probe(cls, latency_s: float, moved_bytes: float, transfer_s: float) -> LinkSpeed:
        """Judge one probe: a reduce-scatter moving `moved_bytes` per rank took `transfer_s`.

        A transfer not clearly longer than the latency says nothing about bandwidth: dividing by their
        difference gave 2097 GB/s once (a 4 MiB probe over a clamped 1 us), and the bucket jumped from
        4.8 MiB to 256 MiB between two runs of one job. Such a probe, or a bandwidth no interconnect
        has, is rejected with its reason.
        """
        bandwidth = moved_bytes / (transfer_s - latency_s) if transfer_s > latency_s else math.inf
        problem = None
        if not (math.isfinite(latency_s) and latency_s > 0 and math.isfinite(transfer_s)):
            problem = f"latency {latency_s!r} s, transfer {transfer_s!r} s"
        elif transfer_s < PROBE_OVER_LATENCY * latency_s:
            problem = (
                f"{moved_bytes / 2**20:.1f} MiB moved in {transfer_s * 1e6:.0f} us, not clearly longer than "
                f"one collective's latency ({latency_s * 1e6:.0f} us)"
            )
        elif bandwidth > PLAUSIBLE_MAX_BANDWIDTH_BPS:
            problem = f"{bandwidth / 1e9:.0f} GB/s per rank, more than any interconnect"
        return cls(latency_s, bandwidth, problem)


PROBE_OVER_LATENCY = 2.0
"""A probe must take at least this many latencies, or it measured noise."""
PLAUSIBLE_MAX_BANDWIDTH_BPS = 1e12
"""Per-rank bytes per second above every interconnect (NVLink 4: 450 GB/s each way)."""
_PROBE_BYTES = (4 << 20, 16 << 20, 64 << 20)
"""Probe sizes tried in turn until one is long enough to time (most links: the first)."""


def measure_link() -> LinkSpeed:
    """Measure the group's collective latency and bandwidth once (a few ms; every rank must call it,
    at the same point). Every rank gets the same numbers (the slowest rank's), so decisions taken
    from them (bucket sizes, hence layouts) agree across ranks; a probe too short to time is
    repeated larger, and a measurement no probe could make plausible says so in `rejected`."""
    if STATE.link is not None:
        return STATE.link
    saved = dict(STATE.bytes_sent), dict(STATE.calls)  # the probe is not the user's traffic
    tiny = torch.zeros(1)
    all_reduce(tiny)  # warm-up: the first collective on a pair pays its connection setup
    lat = []
    for _ in range(8):
        t0 = time.perf_counter()
        all_reduce(tiny)
        lat.append(time.perf_counter() - t0)
    latency = sorted(lat)[len(lat) // 2]
    for probe_bytes in _PROBE_BYTES:
        link = _probe(latency, probe_bytes)
        if link.rejected is None:
            break
    free_buffers()  # the probes' receive buffers are not the training's sizes
    STATE.link = link
    STATE.bytes_sent, STATE.calls = saved
    return link


def _probe(latency: float, probe_bytes: int) -> LinkSpeed:
    n = get_world_size()
    out = torch.empty(probe_bytes // 4 // n)
    probe = torch.zeros(out.numel() * n)
    reduce_scatter(out, probe)  # warm-up: buffers of this size
    big = []
    for _ in range(3):
        t0 = time.perf_counter()
        reduce_scatter(out, probe)
        big.append(time.perf_counter() - t0)
    # Every rank judges the same (slowest) numbers, so all take the same branch in measure_link.
    agreed = torch.tensor([latency, min(big)], dtype=torch.float64)
    all_reduce(agreed, op=ReduceOp.MAX)
    return LinkSpeed.from_probe(float(agreed[0]), probe.numel() * 4 * (n - 1) / n, float(agreed[1]))
