"""ZeRO++'s hierarchical partitioning (hpZ, `zero_optimization.zero_hpz_partition_size` k; arXiv 2306.10209):
the backward's all-gathers stay inside groups of k consecutive ranks (a node).

Stage 3 gathers a unit from every rank in the forward, as without hpZ. When the training forward releases a
trainable unit, each rank keeps a secondary shard of it: its 1/k of the gathered buffer, by its position in its
group of k (`local`). The backward gathers the unit again from those k secondary shards, over the group, instead
of from the N primary shards over the whole world. The values are the gathered buffer's own, so training is
bitwise the same; what changes is where the bytes go. Per step and unit a rank sends its primary shard in the
forward's all-gather (to every other rank) and its gradient in the reduce-scatter, and with hpZ its backward
gather goes to its group only: with k = ranks per node, the bytes crossing nodes fall from 3 to 2 parameter
volumes. The price is the secondary shards' memory, 1/k of each trainable unit between its forward and backward
(memory_report's "secondary").

The primary partition, the masters and the checkpoints are those of plain stage 3. A secondary shard lives from
its unit's training forward to the unit's backward gather (it is dropped when the backward releases the unit),
and every one left is dropped after each backward and each step (a forward whose backward never came).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.comm.collectives import Handle


def secondary_shards(size: int, members: list[int]) -> SecondaryShards | None:
    """hpZ's secondary shards over groups of `size` (zero_hpz_partition_size, checked by the config) consecutive
    ranks of the ZeRO group (`members`), or None when size is 1."""
    if size <= 1:
        return None
    group, local = make_groups(size, members)
    return SecondaryShards(group, size, local)


def make_groups(size: int, members: list[int]) -> tuple[ProcessGroup, int]:
    """(this rank's group, its position in it): `members` (the ZeRO group's ranks, in order) cut into groups of
    `size` consecutive ranks, every group made on every rank (torch's rule)."""
    rank = comm.get_rank()
    groups = [members[i : i + size] for i in range(0, len(members), size)]
    made = [comm.new_group(ranks, "hpz") for ranks in groups]
    index = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return made[index], groups[index].index(rank)


class SecondaryShards:
    """Each kept unit group's secondary shard (keyed by the ShardedGroup object)."""

    def __init__(self, group: ProcessGroup, size: int, local: int) -> None:
        self.group, self.size, self.local = group, size, local
        self._held: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        self.peak_nbytes = 0

    def _span(self, padded_numel: int) -> slice:
        part = padded_numel // self.size  # the layout pads to a multiple of the world, which k divides
        return slice(self.local * part, (self.local + 1) * part)

    def keep(self, key: object, full: torch.Tensor) -> None:
        """Keep this rank's 1/k of a gathered buffer (before it is dropped)."""
        if id(key) in self._held:
            return
        part = full[self._span(full.numel())].clone()
        self._held[id(key)] = part
        self.nbytes += part.numel() * part.element_size()
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def has(self, keys: Sequence[object]) -> bool:
        return bool(keys) and all(id(k) in self._held for k in keys)

    def gather(self, key: object, full: torch.Tensor, unit: int) -> Handle:
        """Start the group's all-gather of the kept buffer into `full` (this rank's part copied in first)."""
        span = self._span(full.numel())
        full[span].copy_(self._held[id(key)])
        work = comm.all_gather(full, full[span], async_op=True, key=unit, group=self.group)
        assert work is not None  # async_op=True always returns a handle
        return work

    def drop(self, keys: Sequence[object]) -> None:
        for k in keys:
            part = self._held.pop(id(k), None)
            if part is not None:
                self.nbytes -= part.numel() * part.element_size()

    def drop_all(self) -> None:
        self._held.clear()
        self.nbytes = 0
