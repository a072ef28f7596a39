"""A NaN loss on one rank in fp32/bf16: the step is skipped on every rank (weights, masters, optimizer
state and LR schedule untouched, skipped_steps counted, a rank-0 warning naming the step), or, with
check_for_nan_in_loss_and_grad, NonFiniteGradientError on every rank before anything moves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from log_records import EngineWarnings

import engine
from engine import NonFiniteGradientError

# (precision, gradient_clipping, check_for_nan_in_loss_and_grad): each runs three steps at 2 ranks, rank 1's
# loss NaN at step 2. Clipping off still finds it: the global norm is computed at every step.
_CASES = [
    ("fp32", 1.0, False),
    ("fp32", 0.0, False),
    ("bf16", 1.0, False),
    ("bf16", 0.0, False),
    ("fp32", 0.0, True),
    ("bf16", 1.0, True),
]


def _snapshot(eng: Any) -> list[torch.Tensor]:
    """Whole weights, the optimizer's parameters (the fp32 masters where there are any) and its state."""
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        weights = [p.detach().float().clone() for p in eng.module.parameters()]
    opt = eng.optimizer
    masters = [p.detach().clone() for group in opt.param_groups for p in group["params"]]
    state = [
        v.detach().clone()
        for group in opt.param_groups
        for p in group["params"]
        for v in opt.state.get(p, {}).values()
        if torch.is_tensor(v)
    ]
    return weights + masters + state


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _one_step(eng: Any, g: torch.Generator, dtype: torch.dtype, nan: bool) -> None:
    x = torch.randn(4, 8, generator=g)
    if nan:
        x[0, 0] = float("nan")
    eng.backward(eng(x.to(dtype)).float().pow(2).mean())
    eng.step()


def _run(stage: int, precision: str, clip: float, stop: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": clip,
        "bf16": {"enabled": precision == "bf16"},
        "check_for_nan_in_loss_and_grad": stop,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    records = EngineWarnings().attach()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    try:
        _one_step(eng, g, dtype, nan=False)
        before, lr = _snapshot(eng), eng.get_lr()
        error = ""
        try:
            _one_step(eng, g, dtype, nan=rank == 1)  # step 2: NaN loss on rank 1 only
        except NonFiniteGradientError as err:
            error = str(err)
        after = _snapshot(eng)
        out = {
            "error": error,
            "unchanged": _same(before, after),
            "lr_unchanged": eng.get_lr() == lr,
            "steps": (eng.global_steps, eng.skipped_steps),
            "finite": all(t.isfinite().all() for t in after),
        }
        _one_step(eng, g, dtype, nan=False)  # step 3 (step 2 again after the error): training goes on
        final = _snapshot(eng)
        out.update(
            moved=not _same(after, final),
            finite_after=all(t.isfinite().all() for t in final),
            steps_after=(eng.global_steps, eng.skipped_steps),
            warnings=[m for m in records.messages if "gradient norm" in m],
        )
        return out
    finally:
        records.detach()
        eng.destroy()


def _matrix(stage: int) -> list[dict[str, Any]]:
    return [_run(stage, *case) for case in _CASES]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nan_loss_on_one_rank_skips_or_stops_the_step_everywhere(stage: int) -> None:
    per_rank = run_distributed(_matrix, 2, args=(stage,))
    for rank, results in enumerate(per_rank):
        for (precision, clip, stop), r in zip(_CASES, results):
            case = f"rank {rank}, stage {stage}, {precision}, gradient_clipping {clip}, stop {stop}"
            assert r["unchanged"] and r["finite"] and r["lr_unchanged"], case
            assert r["moved"] and r["finite_after"], case
            if stop:
                assert r["error"].startswith(f"step 2: the global gradient norm is nan on rank {rank} "), case
                assert "check_for_nan_in_loss_and_grad" in r["error"], case
                assert r["steps"] == (1, 0) and r["steps_after"] == (2, 0), case
                assert r["warnings"] == [], case
            else:
                assert r["error"] == "", case
                assert r["steps"] == (2, 1) and r["steps_after"] == (3, 1), case
                warning = (
                    "step 2: gradient norm is nan (non-finite loss or gradients); the step was skipped: "
                    "weights and optimizer state are unchanged and the LR schedule did not advance, "
                    'skipped_steps 1. Set "check_for_nan_in_loss_and_grad": true to stop training at '
                    "such a step instead"
                )
                want = [warning] if rank == 0 else []
                assert r["warnings"] == want, case


def _stop_inside_a_window() -> dict[str, Any]:
    """gradient_accumulation_steps 2 with the stop option: after the error the window starts again, so
    rerunning its two micro-steps takes the step (before, micro_steps stayed on the window's last
    micro-step, the rerun's first backward was taken as a boundary, and the logged loss kept the NaN)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "check_for_nan_in_loss_and_grad": True,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    try:
        _one_step(eng, g, torch.float32, nan=False)
        try:
            _one_step(eng, g, torch.float32, nan=torch.distributed.get_rank() == 1)
            raised = False
        except NonFiniteGradientError:
            raised = True
        after_error = (eng.global_steps, eng.micro_steps, eng.is_gradient_accumulation_boundary())
        _one_step(eng, g, torch.float32, nan=False)
        _one_step(eng, g, torch.float32, nan=False)
        loss = eng.get_loss()
        return {
            "raised": raised,
            "after_error": after_error,
            "applied": eng.was_step_applied(),
            "after_rerun": (eng.global_steps, eng.micro_steps),
            "loss_finite": loss is not None and loss == loss,
        }
    finally:
        eng.destroy()


def test_stop_inside_an_accumulation_window_restarts_the_window() -> None:
    for r in run_distributed(_stop_inside_a_window, 2):
        assert r["raised"] and r["after_error"] == (0, 0, False), r
        assert r["applied"] and r["after_rerun"] == (1, 2) and r["loss_finite"], r
