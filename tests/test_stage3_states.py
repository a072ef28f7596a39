"""Stage 3's unit and gradient states move only along their tables (engine/zero/stage3/units.py)."""

from __future__ import annotations

import pytest
import torch

from engine.zero.stage3.units import GradState, TrainableGroup, Unit, UnitState, build_units
from engine.zero.state_moves import IllegalStateMove


def _one_unit() -> tuple[Unit, TrainableGroup]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    units = build_units(model, optimizer, None, 0, world=1, rank=0, grad_dtype=lambda dtype: dtype)
    unit = next(u for u in units if u.trainable)
    return unit, unit.trainable[0]


def test_unit_moves_follow_the_table() -> None:
    unit, _ = _one_unit()
    unit.move(UnitState.GATHERING)
    unit.move(UnitState.GATHERED)
    unit.move(UnitState.PARTITIONED)
    unit.move(UnitState.GATHERED)  # a gather that was not prefetched
    with pytest.raises(IllegalStateMove, match=r"unit .* cannot move from GATHERED to GATHERING"):
        unit.move(UnitState.GATHERING)
    assert unit.state is UnitState.GATHERED  # a refused move changes nothing


def test_gradient_moves_follow_the_table() -> None:
    _, g = _one_unit()
    assert g.grad_state is GradState.EMPTY and not g.grad_written
    g.move_grads(GradState.FILLING)
    assert g.filling and not g.grad_written
    g.move_grads(GradState.REDUCING)
    assert g.in_flight and not g.grad_written
    g.move_grads(GradState.REDUCED)
    assert g.grad_written and not g.in_flight
    g.move_grads(GradState.ACCUMULATING)  # the next micro-step of the window adds to it
    assert g.filling and g.grad_written
    with pytest.raises(IllegalStateMove, match="from ACCUMULATING to REDUCING"):
        g.move_grads(GradState.REDUCING)  # would overwrite the reduced gradient instead of adding
    g.move_grads(GradState.ADDING)
    with pytest.raises(IllegalStateMove, match="from ADDING to ACCUMULATING"):
        g.move_grads(GradState.ACCUMULATING)  # a bucket refilled while its reduce-scatter is in flight
    g.move_grads(GradState.EMPTY)  # zero_grad: from anywhere
    assert g.grad_state is GradState.EMPTY
