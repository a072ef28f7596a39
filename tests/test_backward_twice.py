"""engine.backward() twice on one loss: the same named error at every stage and precision, raised
before any state moves, so the step that follows equals the step of a run that called it once."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

import engine


def _train(stage: int, precision: str, twice: bool, retain: bool = False) -> tuple[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    errors = []
    for _ in range(4):  # two optimizer steps of two micro-steps: the error at a boundary and off it
        loss = eng(torch.randn(2, 8, generator=g).to(dtype)).float().pow(2).mean()
        eng.backward(loss, retain_graph=retain)
        if twice:
            with pytest.raises(RuntimeError) as err:
                eng.backward(loss)
            errors.append(str(err.value))
            if retain:  # torch could run it again: the engine must refuse, not count the micro-batch twice
                eng.step()
                continue
            # A new tensor computed from the spent one fails too (at stages 0-1 at a boundary with the
            # stage's own "already reduced" error, which comes first) and changes nothing either.
            with pytest.raises(RuntimeError, match="graph an earlier backward|already reduced|were reduced"):
                eng.backward(loss * 1.0)
        eng.step()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        params = [p.detach().float().clone() for p in eng.module.parameters()]
    eng.destroy()
    assert len(set(errors)) <= 1, errors  # the same message at a boundary and off it
    return (errors[0] if errors else ""), params


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]
)
def test_backward_twice_on_one_loss_is_named_and_harmless(stage: int, precision: str) -> None:
    once = run_distributed(_train, 2, args=(stage, precision, False))
    twice = run_distributed(_train, 2, args=(stage, precision, True))
    for (_, want), (error, got) in zip(once, twice):
        assert error.startswith(
            "engine.backward() was called on a loss whose graph an earlier backward() already freed"
        ), error
        assert "retain_graph=True" in error
        for a, b in zip(want, got):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("stage", "precision"), [(0, "fp32"), (2, "fp32"), (3, "bf16")])
def test_backward_twice_on_one_retained_loss_is_named_and_harmless(stage: int, precision: str) -> None:
    """backward(loss, retain_graph=True) then backward(loss): before, stage 0-1 said "already reduced"
    at a boundary only, stage 2 accumulated the gradient twice in silence, stage 3 failed inside torch
    ("size mismatch ... vec (0)"). Now one named error everywhere, and the run equals a run without it."""
    once = run_distributed(_train, 2, args=(stage, precision, False, True))
    twice = run_distributed(_train, 2, args=(stage, precision, True, True))
    for (_, want), (error, got) in zip(once, twice):
        assert error.startswith("engine.backward() was called twice on the same loss"), error
        assert "add them and call engine.backward() once" in error
        for a, b in zip(want, got):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
