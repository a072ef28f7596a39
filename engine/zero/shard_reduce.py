"""Reducing one bucket of gradients into this rank's fp32 shard-gradient row, and the averaging rule:
the part every stage shares (stages 0-2 per bucket, stage 3 per unit).

DeepSpeed's scaling (`Averaging`): prescale_gradients divides by N before the sum; otherwise the sum
is divided by gradient_predivide_factor before and the rest of the averaging happens at the step,
folded into the one multiply that also unscales and clips. The reduce-scatter writes straight into
the row (float32): the first reduction of a window overwrites it, later ones (gradient accumulation)
add to it, and a low-precision bucket (bf16/fp16 gradients or communication_data_type) travels in
its own dtype while the sum is taken in float32 (engine/comm/collectives.py). A bucket with one slice (stage 0:
every rank keeps the whole gradient) is all-reduced instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import comm
from engine.config.types import EngineConfig


@dataclass(frozen=True)
class Averaging:
    """How the sum over `world` ranks becomes a mean: the only place prescale/predivide are read."""

    world: int
    prescale: bool
    predivide: float

    @classmethod
    def from_config(cls, config: EngineConfig, world: int) -> Averaging:
        return cls(world, config.prescale_gradients, config.gradient_predivide_factor)

    @property
    def before(self) -> float:
        """Factor applied to the local gradient before it is sent."""
        return 1.0 / self.world if self.prescale else 1.0 / self.predivide

    @property
    def after(self) -> float:
        """Factor still owed after the sum (applied at the step)."""
        return 1.0 if self.prescale else self.predivide / self.world


@dataclass
class PendingReduce:
    work: comm.Handle
    out: torch.Tensor | None
    """Where this rank's reduced slice landed, when not straight into the row."""


def start(
    data: torch.Tensor,
    row: torch.Tensor,
    *,
    written: bool,
    rank: int,
    averaging: Averaging,
    scatter: bool = True,
    in_bucket: bool = False,
    key: int = 0,
    real: int | None = None,
    group: comm.ProcessGroup | None = None,
) -> PendingReduce:
    """Start reducing `data` (a whole bucket, every rank's slice) over `group` (the data-parallel group;
    None: the world) towards `row` (this rank's slice; `rank` is its position in the group).
    scatter=False all-reduces the bucket instead (one slice, or reduce_scatter: false), and then only
    its first `real` elements (default all): the layout's padding, zero on every rank, need not travel.
    in_bucket=True reduces into this rank's own slice of `data` instead, and finish() copies (or adds) it
    into the row in one pass, where the dtypes agree: for a row whose stores are costly (a memory-mapped
    gradient, whose pages the reduce-scatter would otherwise write twice: its own contribution, then each
    peer's added), at the same arithmetic."""
    if averaging.before != 1.0:
        data.mul_(averaging.before)
    mine = data[rank * row.numel() : (rank + 1) * row.numel()]
    if not scatter:
        return PendingReduce(comm.all_reduce(data if real is None else data[:real], async_op=True, group=group), mine)
    if in_bucket and data.dtype == row.dtype:
        return PendingReduce(comm.reduce_scatter(mine, data, async_op=True, key=key, group=group), mine)
    return PendingReduce(comm.reduce_scatter(row, data, async_op=True, key=key, accumulate=written, group=group), None)


def store_nothing(row: torch.Tensor, values: torch.Tensor) -> bool:
    """finish()'s default `store`: every row is stored into with row.copy_(values)."""
    return False


def finish(
    pending: PendingReduce,
    row: torch.Tensor,
    *,
    written: bool,
    what: str,
    store: Callable[[torch.Tensor, torch.Tensor], bool] = store_nothing,
) -> None:
    """Wait for the reduction (failing with `what` if the ranks diverged) and fold it into the row.
    `store(row, values)`: row.copy_(values) by other means where it returns True (a memory-mapped row:
    written to its file with O_DIRECT)."""
    comm.wait(pending.work, what)
    if pending.out is not None and not _same_memory(pending.out, row):  # stage 0 in fp32: reduced in place
        if written:
            row.add_(pending.out)
        elif not store(row, pending.out):
            row.copy_(pending.out)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.numel() == b.numel()
        and a.dtype == b.dtype
        and a.is_contiguous()
        and b.is_contiguous()
    )
