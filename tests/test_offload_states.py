"""engine.offload_states / reload_states / empty_partition_cache (DeepSpeed's, for RL loops that colocate a
generation engine), on real processes over gloo.

Training on the CPU, the states already live in host memory: device="cpu" moves nothing. device="nvme" (which
DeepSpeed refuses there) writes each named state's storage to a swap file and frees its RAM until reload_states.
At stages 1, 2 and 3 on 2 ranks: 2 steps, every state offloaded to NVMe and reloaded, 2 more steps: the losses
and final parameters equal the run without the round trip bitwise; between the two the engine refuses to train,
the model's moved parameters read empty, and the process's resident memory falls by most of the bytes moved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

import engine
from engine.runtime.state_offload import StatesOffloadedError
from engine.zero import GatheredParameters

WIDTH = 512
PARAM_BYTES = 4 * (WIDTH * WIDTH + WIDTH) * 4
"""4 layers of 512 x 512 in fp32: 4.2 MB of parameters (the fp32 master is the same memory)."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(stage: int, folder: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    eng, *_ = engine.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    losses, found = [], {}
    for step in range(4):
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = eng(x).square().mean()
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
        if step == 1 and folder is not None:
            before = _rss()
            eng.offload_states(device="nvme", nvme_path=folder)
            found["moved_bytes"] = eng._offloaded.nbytes
            found["rss_drop"] = before - _rss()
            mine = eng._offloaded.swap_dir.path  # this rank's folder of swap files
            found["files"] = len(list(mine.glob("*.swp")))
            found["param_numel"] = sum(p.numel() for p in model.parameters())
            try:
                eng(x)
            except StatesOffloadedError as e:
                found["refused"] = str(e)
            eng.reload_states()
            found["files_after"] = len(list(mine.glob("*.swp"))) if mine.exists() else 0
    with GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    eng.offload_states(device="cpu")  # the states already live in host memory: nothing moves, training goes on
    eng.reload_states()
    eng.empty_partition_cache()
    eng.destroy()
    return {"losses": losses, "params": params, **found}


def _with_and_without(stage: int, folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train(stage, folder), _train(stage, None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_round_trip_is_bitwise_and_frees_the_memory(stage: int, tmp_path: Path) -> None:
    for rank, (got, want) in enumerate(run_distributed(_with_and_without, 2, args=(stage, str(tmp_path)))):
        where = f"stage {stage} rank {rank}"
        assert got["losses"] == want["losses"], where
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"])), where
        assert "call engine.reload_states() first" in got["refused"], where
        assert got["param_numel"] == 0, where  # the moved parameters read empty, never freed memory
        assert got["files"] > 0 and got["files_after"] == 0, where  # swap files written, then removed
        # at least the parameters (whole below stage 3, half at 3) and this rank's half of Adam's two moments
        assert got["moved_bytes"] >= PARAM_BYTES * (1.5 if stage == 3 else 2), where  # and most of it leaves RAM
        assert got["rss_drop"] >= got["moved_bytes"] // 2, (where, got["rss_drop"], got["moved_bytes"])


def _bad_calls() -> list[str]:
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    eng, *_ = engine.initialize(model=model, config=config)
    errors = []
    for call in (
        lambda: eng.offload_states(include=["optimizer"]),
        lambda: eng.offload_states(device="gpu"),
        lambda: eng.offload_states(device="nvme"),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    eng.backward(eng(torch.ones(1, 4)).sum())
    try:
        eng.offload_states()
        errors.append("no error")
    except RuntimeError as e:
        errors.append(str(e))
    eng.destroy()
    return errors


def test_bad_calls_are_refused_by_name() -> None:
    unknown, device, folder, window = run_distributed(_bad_calls, 1)[0]
    assert "unknown state 'optimizer'; the states are optim_states, hp_params, lp_params" in unknown
    assert "offload_states(device='gpu'): unknown device; use one of 'none', 'cpu', 'nvme'" in device
    assert "no folder for the swap files" in folder and "nvme_path" in folder
    assert "inside an accumulation window" in window
