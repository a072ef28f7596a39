"""DeepSpeed LR schedules: curves against closed forms from DeepSpeed's docs, resume, per-group lrs.

Convention (DeepSpeed's): construction sets the lr for iteration -1; the k-th `step()` call moves
to iteration k - 1. `_curve` returns the lr seen by each optimizer step: index 0 is the
construction value, index k the value after k `step()` calls.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _sgd(lrs: tuple[float, ...] = (0.1,), momentum: float = 0.0) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=momentum)


def _adam(lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999))


def _curve(sched: Any, steps: int, group: int = 0) -> list[float]:
    lrs = [sched.optimizer.param_groups[group]["lr"]]
    for _ in range(steps):
        sched.step()
        lrs.append(sched.optimizer.param_groups[group]["lr"])
        assert sched.get_last_lr()[group] == lrs[-1]
    return lrs


def _iterations(steps: int) -> range:
    return range(-1, steps)  # iteration of each _curve entry


# -- closed forms (from DeepSpeed's docstrings, written out independently) -----------------------


def warmup_fraction(it: int, n: int, kind: str) -> float:
    if it >= n:
        return 1.0
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def warmup_lr(it: int, lo: float, hi: float, n: int, kind: str) -> float:
    return lo if it < 0 else lo + (hi - lo) * warmup_fraction(it, n, kind)


def warmup_decay_lr(it: int, lo: float, hi: float, n: int, total: int, kind: str) -> float:
    if it < n:
        return warmup_lr(it, lo, hi, n, kind)
    return hi * max(0.0, (total - it) / (total - n))  # lo + (hi - lo) * gamma with gamma -> 0


def warmup_cosine_ratio(it: int, n: int, total: int, wmin: float, cmin: float, kind: str) -> float:
    if it < 0:
        return 0.0
    if it < n:
        return wmin + (1 - wmin) * warmup_fraction(it, n, kind)
    progress = min(1.0, (it - n + 1) / (total - n))
    return cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress))


# -- WarmupLR / WarmupDecayLR --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_curve(kind: str) -> None:
    sched = WarmupLR(_sgd(), warmup_min_lr=0.01, warmup_max_lr=0.5, warmup_num_steps=50, warmup_type=kind)
    got = _curve(sched, 120)
    want = [warmup_lr(it, 0.01, 0.5, 50, kind) for it in _iterations(120)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[0] == got[1] == 0.01  # construction and iteration 0 both use the min lr
    assert got[-1] == 0.5


def test_warmup_lr_spot_values() -> None:
    # log warmup over 100 steps: iteration 9 -> log(10) / log(100) = 1/2 of the way.
    log = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=100)
    assert _curve(log, 10)[10] == pytest.approx(0.5)
    lin = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    assert _curve(lin, 6)[6] == pytest.approx(0.5)  # iteration 5 of 10


def test_warmup_lr_defaults() -> None:
    sched = WarmupLR(_sgd())  # the optimizer's lr is 0.1
    assert (sched.min_lrs, sched.max_lrs, sched.warmup_num_steps, sched.warmup_type) == (
        [0.0],
        [0.1],
        1000,
        "log",
    )
    assert _curve(sched, 1001)[-1] == pytest.approx(0.1)


def test_warmup_lr_without_max_warms_each_group_up_to_its_own_lr() -> None:
    # DeepSpeed: warmup_max_lr None -> [group["lr"] for group in optimizer.param_groups]. A fixed 1e-3 here
    # trained a config that omits the key at another learning rate, silently (0.000301 against 0.0301).
    opt = _sgd((0.03, 0.3))
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # warmup_min_lr, written at construction
    for _ in range(6):
        sched.step()  # iteration 5 of 10
    assert sched.get_last_lr() == pytest.approx([0.015, 0.15])
    for _ in range(6):
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.03, 0.3])


def test_warmup_decay_lr_keeps_its_own_default_max() -> None:
    # DeepSpeed's WarmupDecayLR passes warmup_max_lr=0.001 explicitly: its default is not the group's lr.
    sched = WarmupDecayLR(_sgd(), total_num_steps=100)
    assert sched.max_lrs == [1e-3]


def test_unknown_warmup_type_is_log_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        sched = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=100, warmup_type="Linear")
    assert sched.warmup_type == "log"
    assert "warmup_type 'Linear'" in caplog.text and '"log"' in caplog.text
    assert _curve(sched, 10)[10] == pytest.approx(0.5)  # log(10) / log(100), not 9 / 100


def test_warmup_lr_per_group_lists() -> None:
    opt = _sgd((0.1, 0.2))
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.3], warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5, 0.2])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.2])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_curve(kind: str) -> None:
    sched = WarmupDecayLR(
        _sgd(),
        total_num_steps=100,
        warmup_min_lr=0.0,
        warmup_max_lr=0.4,
        warmup_num_steps=20,
        warmup_type=kind,
    )
    got = _curve(sched, 130)
    want = [warmup_decay_lr(it, 0.0, 0.4, 20, 100, kind) for it in _iterations(130)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[21] == pytest.approx(0.4)  # iteration 20: peak
    assert got[61] == pytest.approx(0.2)  # iteration 60: halfway down
    assert got[101] == 0.0 and got[-1] == 0.0  # 0 at and after total_num_steps


# -- WarmupCosineLR ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_curve_per_group(kind: str) -> None:
    opt = _sgd((2.0, 0.5))
    sched = WarmupCosineLR(
        opt,
        total_num_steps=110,
        warmup_min_ratio=0.2,
        warmup_num_steps=10,
        cos_min_ratio=0.1,
        warmup_type=kind,
    )
    for group, base in enumerate((2.0, 0.5)):
        fresh = WarmupCosineLR(
            _sgd((2.0, 0.5)),
            total_num_steps=110,
            warmup_min_ratio=0.2,
            warmup_num_steps=10,
            cos_min_ratio=0.1,
            warmup_type=kind,
        )
        got = _curve(fresh, 150, group=group)
        want = [base * warmup_cosine_ratio(it, 10, 110, 0.2, 0.1, kind) for it in _iterations(150)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert sched.get_last_lr() == [0.0, 0.0]  # DeepSpeed starts WarmupCosineLR at lr 0


def test_warmup_cosine_spot_values() -> None:
    opt = _sgd((2.0, 0.5))
    sched = WarmupCosineLR(
        opt,
        total_num_steps=110,
        warmup_min_ratio=0.2,
        warmup_num_steps=10,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(130):
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    assert lrs[6] == pytest.approx([2.0 * 0.6, 0.5 * 0.6])  # iteration 5: 0.2 + 0.5 * 0.8
    assert lrs[60] == pytest.approx([2.0 * 0.55, 0.5 * 0.55])  # iteration 59: half the cosine
    assert lrs[110] == pytest.approx([0.2, 0.05])  # iteration 109: cos_min_ratio reached
    assert lrs[-1] == pytest.approx([0.2, 0.05])  # and held, not rising again


def test_warmup_cosine_defaults() -> None:
    sched = WarmupCosineLR(_sgd(), total_num_steps=5000)
    assert (sched.warmup_min_ratio, sched.warmup_num_steps, sched.cos_min_ratio, sched.warmup_type) == (
        0.0,
        1000,
        1e-4,
        "log",
    )


def test_warmup_cosine_rebuilt_on_same_optimizer_keeps_base_lr() -> None:
    opt = _sgd((0.3,))
    WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)  # sets lr to 0
    again = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert again.org_lrs == [0.3]


# -- LRRangeTest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_curve(staircase: bool) -> None:
    sched = LRRangeTest(
        _sgd(),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=10,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=staircase,
    )
    got = _curve(sched, 60)
    interval = [(it + 1) / 10 for it in _iterations(60)]
    if staircase:
        interval = [float(math.floor(x)) for x in interval]
    assert got == pytest.approx([0.01 * (1 + 2.0 * x) for x in interval], rel=1e-12)
    assert got[0] == 0.01
    assert got[25] == pytest.approx(0.01 * (5.0 if staircase else 6.0))  # iteration 24


def test_lr_range_test_defaults_and_groups() -> None:
    opt = _sgd((0.1, 0.1))
    sched = LRRangeTest(opt, lr_range_test_min_lr=[0.001, 0.002])
    assert (sched.step_size, sched.step_rate, sched.staircase) == (2000, 1.0, False)
    for _ in range(2000):
        sched.step()
    # iteration 1999: interval (1999 + 1) / 2000 = 1, so each group's min lr has doubled.
    assert sched.get_last_lr() == pytest.approx([0.002, 0.004])


# -- OneCycle ------------------------------------------------------------------------------------


def one_cycle_scale(it: int, first: int, second: int, first_stairs: int = 0, second_stairs: int = 0) -> float:
    # Paper form: a triangle over first + second steps, rising on the first part.
    pos = (it + 1) % (first + second)
    if pos <= first:
        frac, stairs = pos / first, first_stairs
    else:
        frac, stairs = (first + second - pos) / second, second_stairs
    return math.floor(frac * stairs + 1e-9) / stairs if stairs else frac


def test_one_cycle_curve_and_momentum() -> None:
    opt = _adam()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=10,
        cycle_second_step_size=20,
        decay_lr_rate=0.5,
        decay_step_size=5,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.01,
    )
    # Construction: min lr and min momentum; beta2 is left as configured.
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.85, 0.999)
    lrs, moms = [], []
    for _ in range(60):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        assert opt.param_groups[0]["betas"][1] == 0.999
    for it in range(60):  # lrs[it] is the value at iteration `it`
        if it < 30:
            s = one_cycle_scale(it, 10, 20)
            want_lr, want_mom = 0.01 + 0.09 * s, 0.95 - 0.1 * s
        else:
            d = (it - 30 + 1) / 5
            want_lr, want_mom = 0.01 / (1 + 0.5 * d), 0.95 * (1 + 0.01 * d)
        assert lrs[it] == pytest.approx(want_lr, rel=1e-12), it
        assert moms[it] == pytest.approx(want_mom, rel=1e-12), it
    assert lrs[9] == pytest.approx(0.1) and moms[9] == pytest.approx(0.85)  # peak lr, lowest momentum
    assert lrs[19] == pytest.approx(0.055) and moms[19] == pytest.approx(0.9)  # halfway down
    assert lrs[34] == pytest.approx(0.01 / 1.5)  # one decay interval after the cycle


def test_one_cycle_without_decay_holds_min_lr() -> None:
    sched = OneCycle(_sgd(momentum=0.9), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    lrs = _curve(sched, 20)
    assert lrs[-1] == pytest.approx(0.01) and lrs[4] == pytest.approx(0.1)
    assert sched.optimizer.param_groups[0]["momentum"] == pytest.approx(0.9)  # SGD momentum cycled; ends at max


def test_one_cycle_stairs() -> None:
    sched = OneCycle(
        _sgd(),
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=10,
        cycle_second_step_size=6,
        cycle_first_stair_count=2,
        cycle_second_stair_count=3,
        cycle_momentum=False,
    )
    lrs = _curve(sched, 16)[1:]
    want = [one_cycle_scale(it, 10, 6, 2, 3) for it in range(16)]
    assert lrs == pytest.approx(want)
    assert lrs[3] == 0.0 and lrs[4] == 0.5 and lrs[9] == 1.0  # stairs of 5 steps, the peak kept


def test_one_cycle_per_group_lists_and_get_mom_per_group() -> None:
    opt = _adam((0.1, 0.2))
    sched = OneCycle(
        opt,
        cycle_min_lr=[0.01, 0.02],
        cycle_max_lr=[0.1, 0.4],
        cycle_first_step_size=4,
        cycle_min_mom=[0.8, 0.7],
        cycle_max_mom=[0.9, 0.95],
    )
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.999), (0.7, 0.999)]
    for _ in range(3):
        sched.step()  # iteration 2: 3 of the 4 rising steps, scale 0.75
    assert sched.get_last_lr() == pytest.approx([0.01 + 0.09 * 0.75, 0.02 + 0.38 * 0.75])
    moms = sched.get_mom()
    assert moms is not None and all(isinstance(m, tuple) and len(m) == 2 for m in moms)  # DeepSpeed's shape
    assert [m[0] for m in moms] == pytest.approx([0.9 - 0.1 * 0.75, 0.95 - 0.25 * 0.75])
    assert [m[1] for m in moms] == [0.999, 0.999]
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([m[0] for m in moms])


def test_one_cycle_second_step_size_zero_only_rises() -> None:
    sched = OneCycle(_sgd(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=0)
    assert _curve(sched, 4)[1:] == pytest.approx([0.25, 0.5, 0.75, 0.0])  # iteration 3 ends the cycle


def test_one_cycle_momentum_off_for_optimizer_without_momentum() -> None:
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1)
    sched.step()
    assert sched.get_mom() is None and "betas" not in opt.param_groups[0]


# -- resume --------------------------------------------------------------------------------------


SCHEDULES = [
    (WarmupLR, {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 30}),
    (WarmupDecayLR, {"total_num_steps": 80, "warmup_num_steps": 30, "warmup_type": "linear"}),
    (WarmupCosineLR, {"total_num_steps": 80, "warmup_num_steps": 30}),
    (LRRangeTest, {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 7}),
    (
        OneCycle,
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 20,
            "decay_lr_rate": 0.1,
            "decay_step_size": 3,
        },
    ),
]


@pytest.mark.parametrize("cls, params", SCHEDULES, ids=[c.__name__ for c, _ in SCHEDULES])
@pytest.mark.parametrize("stop_at", [0, 1, 17, 45])
def test_state_dict_resumes_the_same_curve(cls: type, params: dict[str, Any], stop_at: int) -> None:
    full = cls(_adam((0.1, 0.05)), **params)
    reference = _curve(full, 100, group=1)

    first = cls(_adam((0.1, 0.05)), **params)
    _curve(first, stop_at)
    state = first.state_dict()
    assert state == {"last_batch_iteration": stop_at - 1}

    # A fresh optimizer and schedule, as after a restart; only the schedule state is loaded.
    resumed = cls(_adam((0.1, 0.05)), **params)
    resumed.load_state_dict(state)
    rest = _curve(resumed, 100 - stop_at, group=1)
    assert rest == pytest.approx(reference[stop_at:], rel=1e-12)
    betas = [g["betas"][0] for g in resumed.optimizer.param_groups]
    assert betas == [g["betas"][0] for g in full.optimizer.param_groups]


def test_step_with_explicit_iteration() -> None:
    sched = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.step(4)
    assert sched.get_last_lr() == [pytest.approx(0.4)]
    sched.step()
    assert sched.last_batch_iteration == 5 and sched.get_last_lr() == [pytest.approx(0.5)]


def test_tensor_lr_updated_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.5)
