"""Reducing one bucket of gradients into this rank's fp32 shard-gradient row: the part every sharded
stage shares (stages 1-2 per bucket, stage 3 per unit).

DeepSpeed's scaling: prescale_gradients divides by N before the sum; otherwise the sum is divided by
gradient_predivide_factor before and the rest of the averaging happens at the step. The reduce-scatter
writes straight into the row (float32): the first reduction of a window overwrites it, later ones
(gradient accumulation) add to it, and a low-precision bucket (bf16/fp16 gradients or
communication_data_type) travels in its own dtype while the sum is taken in float32 (engine/comm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import comm


@dataclass
class PendingReduce:
    work: comm.Handle
    out: torch.Tensor | None
    """Where this rank's reduced slice landed, when not straight into the row."""


def start(data: torch.Tensor, row: torch.Tensor, *, written: bool, rank: int, world: int, prescale: bool,
          predivide: float, scatter: bool = True, key: int = 0) -> PendingReduce:
    """Start reducing `data` (a whole bucket, every rank's slice) towards `row` (this rank's slice,
    fp32). scatter=False all-reduces the whole bucket instead (one partition, or reduce_scatter: false)."""
    if prescale:
        data.mul_(1.0 / world)
    elif predivide != 1.0:
        data.mul_(1.0 / predivide)
    mine = data[rank * row.numel():(rank + 1) * row.numel()]
    if not scatter:
        return PendingReduce(comm.all_reduce(data, async_op=True), mine)
    return PendingReduce(comm.reduce_scatter(row, data, async_op=True, key=key, accumulate=written), None)


def finish(pending: PendingReduce, row: torch.Tensor, *, written: bool, what: str) -> None:
    """Wait for the reduction (failing with `what` if the ranks diverged) and fold it into the row."""
    comm.wait(pending.work, what)
    if pending.out is not None:
        if written:
            row.add_(pending.out)
        else:
            row.copy_(pending.out)
