"""Where stage 3's transient buffers come from: gathered units and gradient buckets (ZeRO-R, M_D).

Stage 3 allocates a unit's gathered flat buffer before every use and frees it after, and a gradient
bucket per unit in backward. From the general allocator each of those is fresh memory: big requests
are new mmaps that pay a first-touch page fault per page (copies into fresh memory ran at 2.5-3.3
GB/s here, against 10+ GB/s into touched memory), and mixed sizes fragment the heap. With the arena
(engine/ops/arena.py) all of them are blocks of one pre-touched buffer whose size is fixed before
the first step: it neither fragments nor grows with the number of steps.

# [Note: an arena smaller than the worst case]
A request that does not fit (no free block is large enough) comes from the default allocator, and the
first such request on a rank is logged with the arena's capacity, use and largest free block. "auto"
sizes the arena for the worst case the bounds allow, which never overflows; a number may be smaller,
so that the steady state (a few units gathered, a few buckets) is served from touched memory without
reserving the peak: a model near the machine's memory limit (ZeRO-Infinity) cannot afford the worst
case of 330 MB units pre-touched (3.8 GB a rank at 3.65B parameters), and a smaller arena must not stop
a run that is only slower past it. Measured on a 756M GPT with parameters and optimizer on NVMe (2
ranks, MALLOC_MMAP_THRESHOLD_=1 MiB): the step took 29.4-31.3 s without an arena, 23.5 s with "auto".
A fallback used to be a RuntimeError.

`zero_optimization.stage3_arena_bytes` sizes it: "auto" computes the capacity from the units
and the limits the config already sets (see `auto_capacity`); a number of bytes sets it; absent or 0
leaves the arena off (gathered buffers come from torch.empty, gradient buckets from a BucketPool).
Off is the default because measurement says so: on GPT-M (benchmarks/results/arena_M.md) the arena
saved no step time on this machine, and its auto size (the worst case the bounds allow) raised peak
RSS by 60-90 MiB per rank over glibc, which reuses freed memory well enough at these sizes.
The arena is a CPU buffer, so it serves CPU training only; on CUDA the caching allocator already
recycles blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine import comm
from engine.config.types import ARENA_AUTO
from engine.monitor.log import get_logger
from engine.ops.arena import BLOCK_ALIGN, Arena, block_bytes
from engine.zero.bucket_pool import BucketPool
from engine.zero.stage3.prefetch import PrefetchPlan
from engine.zero.stage3.units import Unit

logger = get_logger()

CONFIG_KEY = "zero_optimization.stage3_arena_bytes"


@dataclass(frozen=True)
class UnitBytes:
    """What one unit can ask for: its gathered buffers and its gradient buckets, in bytes."""

    gathered: int
    buckets: int
    persistent: bool
    """Under stage3_param_persistence_threshold: kept gathered until its gradients are reduced."""
    root: bool


def _blocks(sizes: Sequence[int]) -> int:
    """Bytes the arena spends on these requests: each rounded up to its block alignment."""
    return sum(block_bytes(n) for n in sizes)


def auto_capacity(units: Sequence[UnitBytes], max_live_bytes: int, reduces_in_flight: int) -> int:
    """The most stage 3 can hold at once, from the bounds it keeps (prefetch.py, grads.py):

    - gathered: prefetches and units kept for reuse are admitted only while the live total is
      under stage3_max_live_parameters, the prefetch that crosses it included; on top of that come
      that crossing unit, one unit gathered on demand and the small persistent units. Never more
      than all units at once.
    - buckets: `reduces_in_flight` reduce-scatters in flight, the unit being filled, one spare for a
      unit whose gradients arrive out of order, and the root's (tied weights: filled first and last).
      Never more than all units' buckets at once.
    One largest request more covers fragmentation of the best-fit free list.
    """
    if not units:
        return BLOCK_ALIGN
    gathered_all = _blocks([u.gathered for u in units])
    largest = max(u.gathered for u in units)
    persistent = _blocks([u.gathered for u in units if u.persistent])
    gathered = min(gathered_all, max_live_bytes + 2 * _blocks([largest]) + persistent)
    buckets_all = _blocks([u.buckets for u in units])
    blocks = [u.buckets for u in units if not u.root] or [0]
    root = _blocks([u.buckets for u in units if u.root])
    buckets = min(buckets_all, (reduces_in_flight + 2) * _blocks([max(blocks)]) + root)
    spare = 0 if gathered == gathered_all and buckets == buckets_all else _blocks([max(largest, max(blocks))])
    return gathered + buckets + spare


class Stage3Memory:
    """Gathered buffers and gradient buckets for one Stage3, from an arena or the default allocator."""

    def __init__(
        self, capacity_bytes: int, device: torch.device, bucket_capacity: int, rank: int, *, auto: bool
    ) -> None:
        self.rank = rank
        self.auto = auto
        self.arena = (
            Arena(capacity_bytes, config_key=CONFIG_KEY) if capacity_bytes > 0 and device.type == "cpu" else None
        )
        self._pool = BucketPool(bucket_capacity)
        self.fallbacks = 0
        """Requests the arena could not hold, served by the default allocator."""
        self.bucket_bytes = 0
        self.peak_bucket_bytes = 0

    def gathered(self, numel: int, dtype: torch.dtype, device: torch.device, unit: str) -> torch.Tensor:
        if self.arena is None or device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        return self._allocate(numel, dtype, f"gathering stage-3 unit {unit!r}")

    def bucket(self, numel: int, dtype: torch.dtype, device: torch.device, unit: str) -> torch.Tensor:
        if self.arena is None or device.type != "cpu":
            return self._pool.acquire(numel, dtype, device)
        buf = self._allocate(numel, dtype, f"the gradient bucket of stage-3 unit {unit!r}")
        self.bucket_bytes += buf.numel() * buf.element_size()
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.bucket_bytes)
        return buf

    def release_bucket(self, buf: torch.Tensor) -> None:
        """The caller drops its reference: an arena block is free once no view of it is left."""
        if self.arena is None or buf.device.type != "cpu":
            self._pool.release(buf)
        else:
            self.bucket_bytes -= buf.numel() * buf.element_size()

    def _allocate(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A block of the arena, or, when no free block is large enough, memory from the default allocator
        (see [Note: an arena smaller than the worst case])."""
        assert self.arena is not None
        lent = self.arena.try_allocate((numel,), dtype)
        if lent is not None:
            return lent
        self.fallbacks += 1
        if self.fallbacks == 1:
            nbytes, stats = block_bytes(numel * dtype.itemsize), self.arena.stats()
            sized = "sized from the units and stage3_max_live_parameters" if self.auto else "set by the config"
            logger.warning(
                "rank %d, %s: %d bytes do not fit in the arena (%s: capacity %d bytes, %d in use, largest free "
                "block %d); this and any later request that does not fit come from the default allocator "
                "(fresh memory: slower, not wrong); raise %s to keep every buffer in the arena",
                self.rank,
                what,
                nbytes,
                sized,
                stats["capacity"],
                stats["in_use"],
                stats["largest_free"],
                CONFIG_KEY,
            )
        return torch.empty(numel, dtype=dtype)

    def release_scratch(self) -> None:
        """Drop the pooled bucket buffers not in use (the arena keeps its block)."""
        if not self._pool.in_use:
            self._pool.clear()

    def report(self) -> dict[str, int]:
        """Bytes for memory_report: the arena's capacity and peak use, and the buckets' share."""
        if self.arena is None:
            return {"buckets": self._pool.allocated_bytes, "arena": 0, "arena_peak": 0}
        stats = self.arena.stats()
        return {"buckets": self.peak_bucket_bytes, "arena": stats["capacity"], "arena_peak": stats["peak_in_use"]}

    def close_arena(self) -> None:
        """Allocate from the default allocator from now on; blocks already lent stay valid."""
        self.arena = None

    def clear(self) -> None:
        self._pool.clear()
        self.arena = None


def build_memory(
    units: Sequence[Unit],
    plan: PrefetchPlan,
    wire_dtype: Callable[[torch.dtype], torch.dtype],
    requested: int,
    reduces_in_flight: int,
) -> Stage3Memory:
    """Gathered buffers and gradient buckets: an arena of `requested` bytes
    (zero_optimization.stage3_arena_bytes; ARENA_AUTO: sized from the units), or the default allocator
    (0, the default, or not a CPU model)."""
    groups = [g for u in units for g in u.groups]
    device = groups[0].device if groups else torch.device("cpu")
    needs = [
        UnitBytes(
            gathered=sum(g.layout.padded_numel * g.dtype.itemsize for g in u.groups),
            buckets=sum(g.layout.padded_numel * wire_dtype(g.dtype).itemsize for g in u.trainable),
            persistent=plan.persistent(u.index),
            root=not u.modules,
        )
        for u in units
    ]
    widest = max((g.dtype.itemsize for g in groups), default=4)
    auto = requested == ARENA_AUTO
    capacity = auto_capacity(needs, plan.max_live_numel * widest, reduces_in_flight) if auto else requested
    # Without the arena, gradient buckets are recycled by a pool whose buffers all have the size
    # of the largest block, so units of any size share them.
    blocks = [u for u in units if u.modules] or units
    return Stage3Memory(capacity, device, max((u.numel for u in blocks), default=0), comm.get_rank(), auto=auto)
