"""LossScaler: DeepSpeed's dynamic loss-scale rules, static scaling, config mapping, checkpoints, logs.

Expected sequences are worked out by hand step by step in the comments ("O" = overflow, "C" = clean
step); `it` is the update's index, `last` the index of the last overflow (-1 before any), and the number
after `it` on a clean step is it - last - 1: the clean steps before this one since the last overflow or
the start. DeepSpeed 0.19's rule: a clean step grows the scale when that number is > 0 and a multiple of
the window, i.e. never on the first clean step after an overflow (or on the first step of all), then on
every window-th clean step after it. test_replays_deepspeed_0_19_8_sequences_exactly checks the same
against DeepSpeed 0.19.8's own scaler.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config.types import FP16Config
from engine.monitor.log import get_logger
from engine.precision.loss_scaler import LossScaler

O, C = True, False
DEEPSPEED_SEQUENCES = Path(__file__).resolve().parent / "data" / "loss_scaler" / "deepspeed_0.19.8.json"


def scales_after(scaler: LossScaler, pattern: list[bool]) -> list[float]:
    out = []
    for overflow in pattern:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


@pytest.fixture
def engine_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The "engine" logger does not propagate to root, so hook caplog's handler onto it directly."""
    logger = get_logger()
    logger.addHandler(caplog.handler)
    caplog.clear()
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine" and r.levelno == level]


# --- dynamic sequences ------------------------------------------------------------------------------


def test_growth_from_start_needs_a_full_window_of_clean_steps_after_the_first() -> None:
    s = LossScaler(init_scale=4, scale_window=3, delayed_shift=1)
    # it - (-1) - 1 = it: it0: 0 (never grows)  it1: 1  it2: 2  it3: 3 -> x2=8  it4: 4  it5: 5  it6: 6 -> x2=16
    assert scales_after(s, [C] * 7) == [4, 4, 4, 8, 8, 8, 16]
    assert (s.iterations, s.skipped_steps) == (7, 0)


def test_hysteresis_1_halves_on_every_overflow_and_regrows_after_window() -> None:
    s = LossScaler(init_scale=16, scale_window=3, delayed_shift=1, min_scale=1)
    pattern = [O, C, C, C, C, C, C, O, O, C]
    # it0 O: 16/2=8, last=0 | it1 C: 0 | it2 C: 1 | it3 C: 2 | it4 C: 3 -> 16 | it5: 4 | it6: 5
    # it7 O: 8, last=7 | it8 O: 4, last=8 | it9 C: 0
    assert scales_after(s, pattern) == [8, 8, 8, 8, 16, 16, 16, 8, 4, 4]
    assert (s.iterations, s.skipped_steps, s.last_overflow_iter) == (10, 3, 8)


def test_hysteresis_2_not_consecutive_counts_overflows_until_the_scale_grows() -> None:
    s = LossScaler(init_scale=64, scale_window=3, delayed_shift=2, consecutive_hysteresis=False)
    # four clean steps between the overflows: under DeepSpeed 0.19's rule three no longer grow the scale
    pattern = [O, C, O, C, C, C, C, O, O, O]
    scales, left = [], []
    for overflow in pattern:
        s.update(overflow)
        scales.append(s.scale)
        left.append(s.hysteresis_left)
    # it0 O: absorbed, left 2->1, last=0 | it1 C: 0, left stays 1 (not consecutive)
    # it2 O: left is 1 -> 64/2=32, last=2 | it3 C: 0 | it4 C: 1 | it5 C: 2 | it6 C: 3 -> 64 and left back to 2
    # it7 O: absorbed, left 1, last=7 | it8 O: 32 | it9 O: 16
    assert scales == [64, 64, 32, 32, 32, 32, 64, 64, 32, 16]
    assert left == [1, 1, 1, 1, 1, 1, 2, 1, 1, 1]
    assert s.skipped_steps == 5


def test_hysteresis_2_consecutive_only_counts_back_to_back_overflows() -> None:
    s = LossScaler(init_scale=64, scale_window=3, delayed_shift=2, consecutive_hysteresis=True)
    pattern = [O, C, O, C, C, C, C, O, O, O]  # as in the test above: four clean steps, so the scale grows once
    scales, left = [], []
    for overflow in pattern:
        s.update(overflow)
        scales.append(s.scale)
        left.append(s.hysteresis_left)
    # it0 O: absorbed, left 1, last=0 | it1 C: left reset to 2; 0 | it2 O: absorbed again, left 1, last=2
    # it3 C: left 2; 0 | it4 C: 1 | it5 C: 2 | it6 C: 3 -> 128 | it7 O: absorbed, left 1, last=7
    # it8 O: 64 | it9 O: 32
    assert scales == [64, 64, 64, 64, 64, 64, 128, 128, 64, 32]
    assert left == [1, 2, 1, 2, 2, 2, 2, 1, 1, 1]


def test_absorbed_overflow_still_restarts_the_growth_window() -> None:
    s = LossScaler(init_scale=8, scale_window=3, delayed_shift=2)
    # it0 C: 0 | it1 C: 1 | it2 C: 2 | it3 O: absorbed, last=3 (without it, it3 would have grown to 16)
    # it4 C: 0 | it5 C: 1 | it6 C: 2 | it7 C: 3 -> 16
    assert scales_after(s, [C, C, C, O, C, C, C, C]) == [8, 8, 8, 8, 8, 8, 8, 16]


def test_hysteresis_3_needs_three_overflows_then_every_one_lowers_until_growth() -> None:
    s = LossScaler(init_scale=1024, scale_window=100, delayed_shift=3)
    # left 3->2 (stay), 2->1 (stay), then 1: 512, 256, 128
    assert scales_after(s, [O, O, O, O, O]) == [1024, 1024, 512, 256, 128]


def test_min_scale_is_a_floor() -> None:
    s = LossScaler(init_scale=4, scale_window=100, delayed_shift=1, min_scale=1)
    assert scales_after(s, [O, O, O, O]) == [2, 1, 1, 1]
    assert s.skipped_steps == 4
    # not a power of two: 10 -> 5 -> max(2.5, 3) = 3 -> 3
    s = LossScaler(init_scale=10, scale_window=100, delayed_shift=1, min_scale=3)
    assert scales_after(s, [O, O, O]) == [5, 3, 3]


def test_regrowth_from_the_floor() -> None:
    s = LossScaler(init_scale=2, scale_window=2, delayed_shift=1, min_scale=1)
    # it0 O: 1, last=0 | it1 O: at floor, stays 1, last=1 | it2 C: 0 | it3 C: 1 | it4 C: 2 -> 2 | it5 C: 3
    # it6 C: 4 -> 4
    assert scales_after(s, [O, O, C, C, C, C, C]) == [1, 1, 1, 1, 2, 2, 4]


def test_custom_scale_factor() -> None:
    s = LossScaler(init_scale=81, scale_factor=3, scale_window=2, delayed_shift=1)
    # it0 O: 27, last=0 | it1 C: 0 | it2 C: 1 | it3 C: 2 -> 81
    assert scales_after(s, [O, C, C, C]) == [27, 27, 27, 81]


def _deepspeed_cases() -> list[dict[str, Any]]:
    return json.loads(DEEPSPEED_SEQUENCES.read_text())["cases"]


def test_replays_deepspeed_0_19_8_sequences_exactly() -> None:
    """Every case DeepSpeed 0.19.8's own DynamicLossScaler ran (tests/data/loss_scaler/make_sequences.py):
    the same scale and remaining hysteresis after every step, compared exactly (the same float operations
    in the same order, so no tolerance)."""
    cases = _deepspeed_cases()
    assert len(cases) == 40
    for i, case in enumerate(cases):
        s = LossScaler(dynamic=True, **case["config"])
        scales, left = [], []
        for step in case["pattern"]:
            s.update(step == "O")
            scales.append(s.scale)
            left.append(s.hysteresis_left)
        where = f"case {i}: {case['config']} pattern {case['pattern']}"
        assert scales == case["scales"], where
        assert left == case["hysteresis_left"], where
        assert (s.iterations, s.skipped_steps) == (len(case["pattern"]), case["pattern"].count("O")), where


# --- static -----------------------------------------------------------------------------------------


def test_static_scaler_never_changes() -> None:
    s = LossScaler(dynamic=False, init_scale=128)
    assert not s.dynamic
    assert scales_after(s, [O, O, O, C, C, C, C, O] + [C] * 50) == [128] * 58
    assert (s.iterations, s.skipped_steps) == (58, 4)


# --- config mapping ---------------------------------------------------------------------------------


def test_from_config_dynamic_defaults() -> None:
    s = LossScaler.from_config(FP16Config(enabled=True))
    assert s.dynamic
    assert s.scale == 65536.0
    assert (s.scale_window, s.delayed_shift, s.consecutive_hysteresis, s.min_scale, s.scale_factor) == (
        1000,
        2,
        False,
        1.0,
        2.0,
    )


def test_from_config_dynamic_custom() -> None:
    cfg = FP16Config(
        enabled=True,
        initial_scale_power=8,
        loss_scale_window=50,
        hysteresis=4,
        consecutive_hysteresis=True,
        min_loss_scale=0.25,
    )
    s = LossScaler.from_config(cfg)
    assert s.dynamic and s.scale == 256.0
    assert (s.scale_window, s.delayed_shift, s.hysteresis_left, s.consecutive_hysteresis, s.min_scale) == (
        50,
        4,
        4,
        True,
        0.25,
    )


def test_from_config_static_and_disabled() -> None:
    s = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128))
    assert not s.dynamic and s.scale == 128.0
    s = LossScaler.from_config(FP16Config(enabled=False, loss_scale=0))
    assert not s.dynamic and s.scale == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 0},
        {"scale_window": 0},
        {"delayed_shift": 0},
        {"min_scale": 0},
        {"scale_factor": 1},
    ],
)
def test_invalid_arguments_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LossScaler(**kwargs)


# --- checkpoints ------------------------------------------------------------------------------------


def test_state_dict_round_trip_through_weights_only_load() -> None:
    cfg = FP16Config(enabled=True, initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    a = LossScaler.from_config(cfg)
    for overflow in [O, C, O, O, C]:
        a.update(overflow)
    state = a.state_dict()
    assert all(type(v) in (bool, int, float) for v in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    b = LossScaler.from_config(cfg)
    b.load_state_dict(loaded)
    assert b.state_dict() == state
    tail = [C, C, O, C, C, C, C, O, O]
    assert scales_after(b, tail) == scales_after(a, tail)
    assert b.state_dict() == a.state_dict()


def test_static_scaler_keeps_its_configured_scale_on_load() -> None:
    dyn = LossScaler(init_scale=1024, delayed_shift=1)
    dyn.update(O)
    static = LossScaler(dynamic=False, init_scale=128)
    static.load_state_dict(dyn.state_dict())
    assert static.scale == 128.0
    assert (static.iterations, static.skipped_steps) == (1, 1)


def test_load_state_dict_rejects_incomplete_state() -> None:
    with pytest.raises(KeyError, match="hysteresis_left"):
        LossScaler().load_state_dict(
            {"dynamic": True, "scale": 2.0, "iterations": 0, "skipped_steps": 0, "last_overflow_iter": -1}
        )


# --- logs -------------------------------------------------------------------------------------------


def test_overflow_logs_attempted_and_new_scale(engine_log: pytest.LogCaptureFixture) -> None:
    s = LossScaler(init_scale=65536, delayed_shift=2)
    s.update(O)
    s.update(O)
    s.update(C)
    assert messages(engine_log, logging.INFO) == [
        "fp16 overflow: skipping step, loss scale stays 65536 (hysteresis 1 left: the next overflow reduces it)",
        "fp16 overflow: skipping step, loss scale 65536 -> 32768",
    ]
    assert messages(engine_log, logging.WARNING) == []


def test_hysteresis_3_log_counts_absorbed_overflows(engine_log: pytest.LogCaptureFixture) -> None:
    s = LossScaler(init_scale=8, delayed_shift=3)
    s.update(O)
    assert messages(engine_log, logging.INFO) == [
        "fp16 overflow: skipping step, loss scale stays 8 (hysteresis 2 left: 1 more overflow absorbed first)"
    ]


def test_collapse_to_min_scale_warns_once_and_does_not_raise(engine_log: pytest.LogCaptureFixture) -> None:
    s = LossScaler(init_scale=4, delayed_shift=1, min_scale=1)
    for _ in range(5):
        s.update(O)
    assert s.scale == 1.0
    assert messages(engine_log, logging.INFO) == [
        "fp16 overflow: skipping step, loss scale 4 -> 2",
        "fp16 overflow: skipping step, loss scale 2 -> 1 (min_loss_scale reached)",
        "fp16 overflow: skipping step, loss scale stays 1 (already at min_loss_scale)",
        "fp16 overflow: skipping step, loss scale stays 1 (already at min_loss_scale)",
        "fp16 overflow: skipping step, loss scale stays 1 (already at min_loss_scale)",
    ]
    warnings = messages(engine_log, logging.WARNING)
    assert len(warnings) == 1
    assert "min_loss_scale (1)" in warnings[0]
    assert "diverging" in warnings[0]
    assert "bf16" in warnings[0]
    assert "3 skipped so far" in warnings[0]


def test_static_overflow_logs_skip(engine_log: pytest.LogCaptureFixture) -> None:
    LossScaler(dynamic=False, init_scale=128).update(O)
    assert messages(engine_log, logging.INFO) == ["fp16 overflow: skipping step, loss scale stays 128 (static)"]


def test_clean_steps_log_nothing(engine_log: pytest.LogCaptureFixture) -> None:
    s = LossScaler(init_scale=2, scale_window=1)
    for _ in range(5):
        s.update(C)
    assert s.scale == 32.0  # window 1: it0 (0 clean steps before it) keeps 2, it1-it4 double it four times
    assert messages(engine_log, logging.INFO) == []
