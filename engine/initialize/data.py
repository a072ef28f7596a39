"""training_data -> a DataLoader that gives each rank its share of every global batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

T = TypeVar("T")  # one sample of the dataset; the sampler yields its indices


def build_dataloader(
    dataset: Dataset[T],
    micro_batch_size: int,
    rank: int,
    world_size: int,
    collate_fn: Callable[..., Any] | None = None,
    drop_last: bool = False,
    seed: int = 0,
) -> DataLoader[T]:
    """A DistributedSampler (shuffled, seeded) with the micro batch size, as DeepSpeed builds it.

    Call `loader.sampler.set_epoch(epoch)` each epoch for a new shuffle, as with any sampler.
    """
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
    )
