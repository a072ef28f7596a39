"""A flat stage's buckets and its one record of what the running backward does with its gradients.

A Bucket is one bucket of one flat group (engine/zero/layout.py) in the global launch order: which of
its parameters' gradients are in, the reduction in flight and the buffer it reduces from. Reduction is
the stage's state (IDLE, LOCAL, REDUCING), moved only along REDUCTION_MOVES
(engine/zero/state_moves.py): the one name each act has in engine/zero/flat/stage.py is

    prepare_backward -> _begin_backward   IDLE -> LOCAL or REDUCING
    a bucket complete while REDUCING      its reduction starts (_launch), in the launch order
    _wait_reduction(bk) / _wait_reductions  wait for one / every reduction in flight
    finish_backward                       the rest launched and waited for (_end_round), -> IDLE
    step's _reduce_leftovers              IDLE -> REDUCING -> IDLE over what no backward reduced
    zero_grad                             any -> IDLE
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.zero import shard_reduce
from engine.zero.flat_groups import FlatGroup


class Reduction(enum.Enum):
    """What the running backward of a flat stage does with its gradients: the one record of it."""

    IDLE = "idle"
    """No backward is running (the window's start, between micro-steps, after zero_grad)."""
    LOCAL = "local"
    """A backward keeps its gradients local: a non-boundary micro-step at stages 0-1, or engine.no_sync().
    They wait (in the flat gradient buffer, or stage 2's no_sync buffers) for the next round."""
    REDUCING = "reducing"
    """A backward (or step()'s round over what no backward reduced) reduces each bucket as it completes,
    overlapped with the rest of the backward, in the global launch order."""


REDUCTION_MOVES: dict[Reduction, frozenset[Reduction]] = {
    Reduction.IDLE: frozenset({Reduction.LOCAL, Reduction.REDUCING}),
    Reduction.LOCAL: frozenset({Reduction.IDLE, Reduction.LOCAL, Reduction.REDUCING}),
    Reduction.REDUCING: frozenset({Reduction.IDLE, Reduction.LOCAL, Reduction.REDUCING}),
}
"""The legal moves besides zero_grad's return to IDLE: a backward starts, and ends with finish_backward.
A backward that raised before its finish_backward is followed by the next one's start (LOCAL/REDUCING to
LOCAL/REDUCING: its round starts over); IDLE -> IDLE is not a move (finish_backward without a backward
does nothing)."""


@dataclass(eq=False)
class Bucket:
    """One bucket of one flat group, in the global launch order."""

    order: int
    group: FlatGroup
    b: int
    params: list[int]
    """Indices (in the group) of the parameters with elements in this bucket."""
    ready: set[int] = field(default_factory=set)
    """Parameters whose gradient for this reduction has been written."""
    pending: shard_reduce.PendingReduce | None = None
    """The reduction in flight, waited for in _wait_reduction."""
    data: torch.Tensor | None = None
    """The bucket_numel elements being reduced (wire dtype)."""
    pooled: bool = False
    """`data` came from the bucket pool and goes back to it when the reduction finishes."""

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def portion(self, i: int) -> tuple[slice, slice]:
        """(range in the bucket, range in the flattened parameter) of parameter i's elements here."""
        span = self.group.layout.params[i]
        start, end = self.group.layout.bucket_range(self.b)
        lo, hi = max(start, span.offset), min(end, span.end)
        return slice(lo - start, hi - start), slice(lo - span.offset, hi - span.offset)
