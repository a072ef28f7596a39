"""Which gradient elements this rank counts in the global gradient norm, and over which ranks the local
sums of squares add up to the whole model's.

# [Note: the norm over tensor x data parallelism]
# ZeRO partitions every gradient over the data-parallel group, and tensor parallelism splits the
# tensor-parallel layers over the tensor-parallel group, so a partitioned stage's shards over the
# whole world cover the model, each element once: except parameters every tensor-parallel rank
# holds whole (layer norms, a row-parallel layer's bias; Megatron marks the others
# `tensor_model_parallel`). Their gradients are equal on every tensor-parallel rank, so only
# tensor-parallel rank 0 counts them (Megatron's param_is_not_tensor_parallel_duplicate). Stage 0
# keeps whole gradients on every data-parallel rank, so its sums add over the tensor-parallel group
# only. Without tensor parallelism this is the old rule: the whole shard, summed over the world when
# partitioned. The overflow check rides on the same sum (an inf/nan anywhere makes it non-finite):
# an uncounted replicated element is counted, with the same value, by tensor-parallel rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.comm import ProcessGroup
from engine.ops.flatten import contiguous_pieces
from engine.parallel.groups import ParallelGroups
from engine.parallel.layers import is_tensor_parallel
from engine.zero.layout import GroupLayout


@dataclass(frozen=True)
class NormScope:
    """Where the local sums of squares of the counted rows are added up (see the Note)."""

    reduce: bool
    """False: this rank alone holds the whole gradient (stage 0 without tensor parallelism)."""
    group: ProcessGroup | None
    """The ranks whose sums are added (None: the world)."""

    @classmethod
    def of(cls, parallel: ParallelGroups, *, partitioned: bool) -> NormScope:
        if partitioned:
            return cls(reduce=True, group=None)
        return cls(reduce=parallel.tp_size > 1, group=parallel.tp_group)


Runs = tuple[tuple[int, int], ...] | None
"""(shard offset, elements) of the runs of a group's gradient shard this rank counts; None: all of it."""


def counted_runs(layout: GroupLayout, rank: int, params: Sequence[torch.Tensor], parallel: ParallelGroups) -> Runs:
    """The runs of `rank`'s shard of `layout` this rank counts in the norm: all of it, or, on a
    tensor-parallel rank other than 0, all but the pieces of parameters replicated over tensor
    parallelism (see the Note). Pure arithmetic on the layout: computed once, when a stage is built."""
    if parallel.tp_size == 1 or parallel.counts_replicated():
        return None
    counted = [is_tensor_parallel(p) for p in params]
    if all(counted):
        return None
    runs: list[tuple[int, int]] = []
    for piece in layout.rank_pieces(rank):
        if not counted[piece.param]:
            continue
        start = piece.shard_offset
        if runs and sum(runs[-1]) == start and start % layout.slice_numel:  # adjacent, same bucket's row
            runs[-1] = (runs[-1][0], runs[-1][1] + piece.numel)
        else:
            runs.append((start, piece.numel))
    return tuple(runs)


def counted_rows(shard_grad: torch.Tensor, runs: Runs, slice_numel: int) -> list[torch.Tensor]:
    """Contiguous 1-D views of `runs` of a gradient shard (flat, or (buckets, slice) with a row per
    bucket): what this rank counts in the norm at this step."""
    rows = contiguous_pieces([shard_grad])[0]
    if runs is None:
        return rows
    if len(rows) == 1:  # the shard is one contiguous run
        return [rows[0][start : start + n] for start, n in runs]
    return [rows[start // slice_numel][start % slice_numel : start % slice_numel + n] for start, n in runs]
