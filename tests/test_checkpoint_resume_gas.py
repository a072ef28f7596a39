"""Resuming with another gradient_accumulation_steps: the run resumes at the start of an accumulation
window of the new size (a checkpoint holds no partly accumulated gradients), so the first step after
the load averages exactly the new number of micro-batches, as training with that setting from the
saved state would."""

from __future__ import annotations

from pathlib import Path

import torch

import engine

MICRO = 2


def _engine(gas: int) -> engine.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(n)]


def _micro_step(eng: engine.Engine, x: torch.Tensor, y: torch.Tensor) -> None:
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    eng.step()


def test_resume_with_more_accumulation_steps_starts_a_full_window(tmp_path: Path) -> None:
    saver = _engine(gas=2)
    for x, y in _batches(2 * 2 + 1, seed=1):  # 2 steps, then 1 micro-step into the third window
        _micro_step(saver, x, y)
    assert saver.micro_steps == 5
    saver.save_checkpoint(str(tmp_path), tag="t")
    saved = {k: v.clone() for k, v in saver.consolidated_state_dict().items()}
    saver.destroy()

    resumed = _engine(gas=4)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert (resumed.global_steps, resumed.micro_steps) == (2, 8)  # the start of a 4-micro-step window
    batches = _batches(4, seed=2)
    for i, (x, y) in enumerate(batches):
        assert resumed.is_gradient_accumulation_boundary() == (i == 3)
        _micro_step(resumed, x, y)
    assert resumed.global_steps == 3
    got = resumed.consolidated_state_dict()
    resumed.destroy()

    # The same step by hand: SGD on the mean of the 4 micro-batches' gradients, from the saved weights.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.load_state_dict(saved)
    for x, y in batches:
        (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
