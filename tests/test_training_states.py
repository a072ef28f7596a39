"""The Engine's accumulation window (engine/runtime/window.py) and the flat stages' reduction
(engine/zero/flat/bucket.py) move only along their tables, as stage 3's units do (test_stage3_states.py):
an illegal move raises naming both states and changes nothing."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.runtime.engine import DestroyedEngineError
from engine.runtime.window import TrainingWindow, WindowState
from engine.zero.flat.bucket import REDUCTION_MOVES, Reduction
from engine.zero.state_moves import IllegalStateMove
from models import make_model

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


def test_window_moves_follow_the_table() -> None:
    window = TrainingWindow(gradient_accumulation_steps=2)
    assert window.state is WindowState.EMPTY
    window.add_backward(torch.tensor(1.0))
    window.add_backward(torch.tensor(3.0))
    assert window.state is WindowState.ACCUMULATING and window.backwards == 2
    with window.stepping():
        assert window.state is WindowState.STEPPING
        with pytest.raises(IllegalStateMove, match="training window cannot move from STEPPING to ACCUMULATING"):
            window.add_backward(torch.tensor(5.0))  # a backward inside the step: refused
        assert window.backwards == 2  # a refused move changes nothing
        window.global_steps += 1
    assert window.state is WindowState.EMPTY and window.last_loss == 2.0 and window.backwards == 0
    window.destroy()
    with pytest.raises(IllegalStateMove, match="from DESTROYED to ACCUMULATING"):
        window.add_backward(torch.tensor(1.0))
    assert window.state is WindowState.DESTROYED


def test_a_step_that_raises_gives_the_window_back() -> None:
    window = TrainingWindow(gradient_accumulation_steps=1)
    window.add_backward(torch.tensor(2.0))
    with pytest.raises(ValueError, match="the stage failed"), window.stepping():
        raise ValueError("the stage failed")
    assert window.state is WindowState.ACCUMULATING and window.backwards == 1 and window.last_loss is None


def test_a_dropped_window_restarts_at_the_last_steps_micro_step() -> None:
    window = TrainingWindow(gradient_accumulation_steps=4)
    window.global_steps, window.micro_steps = 3, 14
    window.boundary_override = True
    window.add_backward(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="non-finite"), window.stepping():
        window.drop()
        raise RuntimeError("non-finite")
    assert window.state is WindowState.EMPTY and window.micro_steps == 12 and window.boundary_override is None


def test_engine_window_through_a_training_loop() -> None:
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=make_model(), config=CONFIG)
    try:
        window = eng._window
        assert window.state is WindowState.EMPTY
        eng.backward(eng(torch.randn(2, 16)).pow(2).mean())
        eng.step()  # not a boundary: the window goes on
        assert window.state is WindowState.ACCUMULATING and eng.micro_steps == 1 and eng.global_steps == 0
        eng.backward(eng(torch.randn(2, 16)).pow(2).mean())
        eng.step()
        assert window.state is WindowState.EMPTY and eng.micro_steps == 2 and eng.global_steps == 1
        assert eng.get_loss() is not None and eng.was_step_applied()
    finally:
        eng.destroy()
    assert eng._window.state is WindowState.DESTROYED
    with pytest.raises(DestroyedEngineError):
        eng.step()


def test_reduction_moves_follow_the_table() -> None:
    # The table itself: a backward starts only from IDLE or after one that raised, and always ends in IDLE.
    assert Reduction.IDLE not in REDUCTION_MOVES[Reduction.IDLE]
    for state in (Reduction.LOCAL, Reduction.REDUCING):
        assert Reduction.IDLE in REDUCTION_MOVES[state]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_flat_stage_reduction_states(stage: int) -> None:
    torch.manual_seed(0)
    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    eng, *_ = engine.initialize(model=make_model(), config=config)
    flat = eng._stage
    try:
        assert flat.reduction is Reduction.IDLE
        flat.prepare_backward(boundary=False, sync=True)
        # Stage 2 reduces every synchronised micro-step; stages 0-1 only at the boundary.
        assert flat.reduction is (Reduction.REDUCING if stage == 2 else Reduction.LOCAL)
        eng(torch.randn(2, 16)).pow(2).mean().backward()
        flat.finish_backward()
        assert flat.reduction is Reduction.IDLE
        with pytest.raises(
            IllegalStateMove, match=rf"stage {stage}: the gradient reduction cannot move from IDLE to IDLE"
        ):
            flat.move_reduction(Reduction.IDLE)
        assert flat.reduction is Reduction.IDLE  # a refused move changes nothing
        flat.zero_grad()
        assert flat.reduction is Reduction.IDLE
    finally:
        eng.destroy()
