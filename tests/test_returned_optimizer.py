"""The loop shapes users write, with the optimizer engine.initialize returns (engine/runtime/zero_optimizer.py).

Before, a loop that called optimizer.zero_grad() trained nothing in fp32 at every stage (the masters'
.grad binding was dropped; weights moved 0.0, no error), and optimizer.step() called instead of
engine.step() (Lightning Fabric's loop) updated nothing at any precision. Every shape below must
give the README loop's weights exactly, at stages 0-3 in fp32, bf16 and fp16 on 2 ranks, and the
README loop in fp32 must match plain single-process AdamW.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import engine
from engine.optim.schedules import WarmupLR
from engine.zero.master_step import DirectOptimizerStepError
from tests.distributed import run_distributed
from tests.models import global_batches, make_model, rank_micro_batch

STEPS, MICRO, WORLD = 4, 4, 2
ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}


def _config(stage: int, precision: str, gas: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.05}},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _weights(eng: engine.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in eng.consolidated_state_dict(torch.device("cpu")).items()}


def _train(stage: int, precision: str, shape: str, gas: int) -> dict[str, Any]:
    """One engine trained STEPS optimizer steps with the loop `shape`; its weights, lr and counters."""
    model = make_model()
    user_opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
    config = _config(stage, precision, gas)
    eng, opt, _, _ = engine.initialize(model=model, optimizer=user_opt, config=config)
    dtype = next(p.dtype for p in eng.module.parameters())
    rank = torch.distributed.get_rank()
    try:
        for x, y in global_batches(STEPS, MICRO * WORLD * gas):
            for k in range(gas):
                xm, ym = rank_micro_batch((x, y), rank, WORLD, MICRO, k)
                if shape == "zero_grad_each_micro_step":  # hand-written loops; Lightning at window starts
                    opt.zero_grad()
                elif shape == "user_optimizer_zero_grad":  # the torch optimizer the user still holds
                    user_opt.zero_grad()
                loss = torch.nn.functional.mse_loss(eng(xm.to(dtype)).float(), ym)
                eng.backward(loss)
                if shape != "optimizer_step":
                    eng.step()
            if shape == "optimizer_step":  # Lightning Fabric: optimizer.step() instead of engine.step()
                opt.zero_grad()
                opt.step()
        return {
            "weights": _weights(eng),
            "lr": eng.get_lr(),
            "global_steps": eng.global_steps,
            "skipped": eng.skipped_steps,
            "micro_steps": eng.micro_steps,
        }
    finally:
        eng.destroy()


SHAPES = ["readme", "zero_grad_each_micro_step", "user_optimizer_zero_grad", "optimizer_step"]


def _all_shapes(stage: int) -> dict[tuple[str, str, int], dict[str, Any]]:
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        for shape in SHAPES:
            out[(precision, shape, 1)] = _train(stage, precision, shape, gas=1)
    for shape in ("readme", "zero_grad_each_micro_step", "optimizer_step"):  # an accumulation window of 2
        out[("fp32", shape, 2)] = _train(stage, "fp32", shape, gas=2)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_loop_shape_trains_like_the_readme_loop(stage: int) -> None:
    results = run_distributed(_all_shapes, WORLD, args=(stage,), timeout=240)[0]
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for (precision, shape, gas), got in results.items():
        want = results[(precision, "readme", gas)]
        what = f"stage {stage}, {precision}, gas {gas}, loop {shape}"
        moved = max((got["weights"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-3, f"{what}: the weights did not move ({moved})"
        assert got["global_steps"] == STEPS and got["skipped"] == want["skipped"], what
        assert got["lr"] == want["lr"], f"{what}: the LR schedule advanced differently"
        for k in want["weights"]:
            assert torch.equal(got["weights"][k], want["weights"][k]), (
                f"{what}: {k} differs from the README loop's by {(got['weights'][k] - want['weights'][k]).abs().max()}"
            )
    _check_against_reference(results, stage)


def _check_against_reference(results: dict[tuple[str, str, int], dict[str, Any]], stage: int) -> None:
    """The README loop in fp32 equals single-process AdamW with the same WarmupLR schedule."""
    for gas in (1, 2):
        batches = global_batches(STEPS, MICRO * WORLD * gas)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
        sched = WarmupLR(opt, warmup_num_steps=3, warmup_max_lr=0.05)
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        got = results[("fp32", "readme", gas)]["weights"]
        for k, v in model.state_dict().items():
            torch.testing.assert_close(
                got[k],
                v.float(),
                rtol=2e-5,
                atol=2e-6,
                msg=lambda m, k=k, gas=gas: f"stage {stage}, gas {gas}, {k}: {m}",
            )


def _direct_step_on_user_optimizer(stage: int) -> dict[str, Any]:
    model = make_model()
    user_opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = {k: v for k, v in _config(stage, "fp32", 1).items() if k != "scheduler"}  # WarmupLR's first lr is 0
    eng, opt, _, _ = engine.initialize(model=model, optimizer=user_opt, config=config)
    try:
        x, y = global_batches(1, MICRO)[0]
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        before = _weights(eng)
        try:
            user_opt.step()
            raised = ""
        except DirectOptimizerStepError as err:
            raised = str(err)
        unchanged = all(torch.equal(v, before[k]) for k, v in _weights(eng).items())
        eng.step()  # the process goes on: the engine's own step still works
        moved = any(not torch.equal(v, before[k]) for k, v in _weights(eng).items())
        container = torch.nn.ModuleList([eng])  # Lightning Fabric scans module.modules() for the engine
        return {
            "raised": raised,
            "unchanged": unchanged,
            "moved": moved,
            "is_module": isinstance(eng, torch.nn.Module),
            "found": any(m is eng for m in container.modules()),
            "is_optimizer": isinstance(opt, torch.optim.Optimizer),
            "same_groups": opt.param_groups is user_opt.param_groups,
        }
    finally:
        eng.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_step_on_the_users_own_optimizer_is_refused_and_the_engine_is_a_module(stage: int) -> None:
    results = run_distributed(_direct_step_on_user_optimizer, WORLD, args=(stage,))
    assert results[0]["unchanged"] and results[0]["moved"]  # rank 0 holds the consolidated weights
    for r in results:
        assert "engine.step()" in r["raised"] and "AdamW given to engine.initialize()" in r["raised"], r["raised"]
        assert r["is_module"] and r["found"] and r["is_optimizer"] and r["same_groups"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_schedules_see_the_engines_steps(precision: str) -> None:
    """A torch schedule built on the user's optimizer (lr_scheduler= callable) or on the returned one must
    not warn "lr_scheduler.step() before optimizer.step()": bf16's fused Adam steps without calling
    optimizer.step() (it warned before), and engine.step() steps without the returned optimizer's step()."""
    model = make_model()
    config = {**_config(2, precision, 1), "train_micro_batch_size_per_gpu": MICRO}
    config.pop("scheduler")
    eng, opt, _, _ = engine.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
    )
    on_returned = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    dtype = next(eng.module.parameters()).dtype
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
            for x, y in global_batches(2, MICRO):
                eng.backward(torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y))
                eng.step()  # steps the given schedule itself
                on_returned.step()
    finally:
        eng.destroy()
