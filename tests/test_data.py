"""training_data -> the engine's DataLoader: each rank a disjoint share, micro-batch sized, seeded."""

from __future__ import annotations

import torch

import engine
from distributed import run_distributed
from models import make_model


def _epoch_indices(seed: int | None) -> list[list[int]]:
    dataset = torch.utils.data.TensorDataset(torch.arange(32))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if seed is not None:
        config["seed"] = seed
    eng, _, loader, _ = engine.initialize(model=make_model(), config=config, training_data=dataset)
    try:
        batches = [batch[0].tolist() for batch in loader]
    finally:
        eng.destroy()
    assert all(len(b) == 4 for b in batches)
    return batches


def test_training_data_is_split_across_ranks_at_the_micro_batch_size() -> None:
    rank0, rank1 = run_distributed(_epoch_indices, 2, args=(None,))
    seen0, seen1 = sum(rank0, []), sum(rank1, [])
    assert len(rank0) == len(rank1) == 4  # 32 samples / 2 ranks / micro 4
    assert not set(seen0) & set(seen1) and sorted(seen0 + seen1) == list(range(32))
    assert seen0 != sorted(seen0)  # shuffled
    other_seed = run_distributed(_epoch_indices, 2, args=(7,))[0]
    assert sum(other_seed, []) != seen0  # the config's seed drives the shuffle
