"""The first forward under tensor parallelism checks that every rank of a tensor-parallel group got the
same batch (DeepSpeed's AutoTP does the same check): the ranks of one group compute one model on one
batch, and a data loader that shards by global rank instead of data-parallel rank trains every
tensor-parallel slice on other data, silently wrong. One small all-gather per group and one
all-reduce over the world, once, so every rank raises together when any group disagrees.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from engine import comm
from engine.parallel.groups import ParallelGroups


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A fixed-size summary of every tensor input: count, elements, sum, and a position-weighted sum
    (so a reordered batch differs too)."""
    out = torch.zeros(4, dtype=torch.float64)
    for t in _tensors((args, kwargs)):
        flat = t.detach().reshape(-1).to("cpu", torch.float64)
        out[0] += 1
        out[1] += flat.numel()
        out[2] += flat.sum()
        out[3] += (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()
    return out


def check_same_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], parallel: ParallelGroups) -> None:
    """Raise on every rank if the ranks of any tensor-parallel group got different inputs."""
    digests = comm.all_gather_list(_digest(args, kwargs), group=parallel.tp_group)
    differing = [parallel.tp_ranks[i] for i, d in enumerate(digests) if not torch.equal(d, digests[0])]
    verdict = torch.tensor([float(len(differing))])
    comm.all_reduce(verdict, op=comm.ReduceOp.MAX)
    if verdict.item():
        where = (
            f"ranks {differing} got other inputs than rank {parallel.tp_ranks[0]} of their tensor-parallel group "
            f"{list(parallel.tp_ranks)}"
            if differing
            else "another tensor-parallel group's ranks got different inputs"
        )
        raise RuntimeError(
            f"the first forward under tensor parallelism (size {parallel.tp_size}): {where}. Every rank of a "
            "tensor-parallel group must compute on the same batch: shard the data by data-parallel rank "
            f"(engine.parallel.get_data_parallel_rank(), {parallel.dp_size} shards), as the dataloader "
            "engine.initialize(training_data=...) returns does, not by global rank"
        )
