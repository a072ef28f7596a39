"""build_scheduler: names (DeepSpeed and torch), parameter checks and their messages."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config.errors import ConfigError
from engine.config.types import SchedulerConfig
from engine.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def _opt(groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=0.1)


def _build(name: str, params: dict[str, Any] | None = None, groups: int = 1):
    return build_scheduler(SchedulerConfig(name, params or {}), _opt(groups))


@pytest.mark.parametrize(
    "name, params, cls",
    [
        ("WarmupLR", {}, WarmupLR),
        ("warmuplr", {"warmup_max_lr": 0.01, "last_batch_iteration": -1}, WarmupLR),
        ("WarmupDecayLR", {"total_num_steps": 100}, WarmupDecayLR),
        ("WARMUPCOSINELR", {"total_num_steps": 100}, WarmupCosineLR),
        ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}, OneCycle),
        ("LRRangeTest", {}, LRRangeTest),
        ("StepLR", {"step_size": 10, "gamma": 0.5}, torch.optim.lr_scheduler.StepLR),
        ("cosineannealinglr", {"T_max": 100}, torch.optim.lr_scheduler.CosineAnnealingLR),
    ],
)
def test_name_maps_to_class(name: str, params: dict[str, Any], cls: type) -> None:
    assert type(_build(name, params)) is cls


def test_params_reach_the_schedule() -> None:
    sched = _build(
        "WarmupLR",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7, "warmup_type": "linear"},
    )
    assert (sched.min_lrs, sched.max_lrs, sched.warmup_num_steps, sched.warmup_type) == (
        [0.001],
        [0.01],
        7,
        "linear",
    )
    assert sched.optimizer.param_groups[0]["lr"] == 0.001


def test_unknown_type_suggests_closest() -> None:
    with pytest.raises(ConfigError, match=r'scheduler\.type "WarmupCosine" .*Did you mean "WarmupCosineLR"'):
        _build("WarmupCosine")


def test_unknown_param_names_key() -> None:
    with pytest.raises(ConfigError) as info:
        _build("WarmupLR", {"warmup_steps": 10})
    msg = str(info.value)
    assert "scheduler.params.warmup_steps" in msg and 'Did you mean "warmup_num_steps"' in msg
    assert "warmup_max_lr" in msg  # the accepted names are listed


def test_unknown_param_for_torch_schedule() -> None:
    with pytest.raises(ConfigError, match=r'scheduler\.params\.gama .*StepLR.*Did you mean "gamma"'):
        _build("StepLR", {"step_size": 2, "gama": 0.1})


@pytest.mark.parametrize(
    "name, missing",
    [
        ("OneCycle", ["cycle_max_lr", "cycle_min_lr"]),
        ("WarmupDecayLR", ["total_num_steps"]),
        ("WarmupCosineLR", ["total_num_steps"]),
        ("StepLR", ["step_size"]),
    ],
)
def test_missing_required_params(name: str, missing: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _build(name)
    for key in missing:
        assert f"scheduler.params.{key} is required" in str(info.value)


@pytest.mark.parametrize(
    "name, params, key",
    [
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 10.5}, "warmup_num_steps"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "warmup_max_lr"),  # 2 values, 1 group
        ("WarmupCosineLR", {"total_num_steps": -5}, "total_num_steps"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": "high"}, "cycle_max_lr"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_stair_count": -1},
            "cycle_first_stair_count",
        ),
    ],
)
def test_bad_values_name_the_key(name: str, params: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"scheduler\.params\.{key}"):
        _build(name, params)


def test_torch_value_errors_become_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.params .*OneCycleLR"):
        _build("OneCycleLR", {"max_lr": 0.1})  # needs total_steps or epochs + steps_per_epoch


def test_a_config_without_warmup_max_lr_trains_at_the_optimizers_lr() -> None:
    # The loop a DeepSpeed user runs: the config names the optimizer's lr once, and WarmupLR warms up to it.
    import engine

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.03}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
    }
    eng, _, _, scheduler = engine.initialize(model=torch.nn.Linear(4, 2), config=config)
    try:
        seen = []
        for _ in range(6):
            eng.backward(eng(torch.randn(2, 4)).square().mean())
            eng.step()
            seen.append(eng.get_lr()[0])
        assert seen[:3] == pytest.approx([0.0, 0.0075, 0.015]) and seen[-1] == pytest.approx(0.03), seen
        assert scheduler.max_lrs == [0.03]
    finally:
        eng.destroy()
