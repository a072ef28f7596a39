"""Stage 3 with its memory arena (engine/zero/stage3/memory.py) on real processes over gloo: the same
training as without it, bitwise; every block back in one free block after each step (no
fragmentation); a bounded auto size under stage3_max_live_parameters; the compiled arena and its
torch fallback alike; a named error when an explicit size is too small."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from test_stage3 import LR, MICRO, WIDTH, Block, batches, param_groups

import engine

STEPS = 4
BLOCKS = 8  # enough units that a bound under stage3_max_live_parameters is below the whole model


class Deep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.blocks[1].norm.requires_grad_(False)  # frozen parameters inside a unit
        self.out = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.inp.weight  # tied: the root's gradient bucket fills first and last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_net(seed: int) -> Deep:
    torch.manual_seed(seed)
    return Deep()


def _train(zero: dict[str, Any], dtype: str) -> dict[str, Any]:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": 3, **zero},
        },
    )
    arena = eng._stage._memory.arena
    losses, after_steps = [], []
    for step, (x, y) in enumerate(batches(2 * STEPS, MICRO)):
        loss = torch.nn.functional.mse_loss(eng(x.to(eng.module.inp.weight.dtype)).float(), y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        if arena is not None and step % 2 == 1:
            stats = arena.stats()
            after_steps.append((stats["in_use"], stats["free_blocks"], stats["allocations"]))
    report = eng.memory_report()
    state = eng._stage.consolidated_state_dict()
    eng.destroy()
    return {
        "losses": losses,
        "state": state,
        "memory": report,
        "after_steps": after_steps,
        "compiled": None if arena is None else arena.compiled,
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_arena_trains_bitwise_like_the_default_allocator(dtype: str) -> None:
    with_arena = run_distributed(_train, 2, args=({"stage3_arena_bytes": "auto"}, dtype))
    without = run_distributed(_train, 2, args=({}, dtype))  # the default: no arena
    for a, b in zip(with_arena, without):
        assert a["losses"] == b["losses"]
        assert a["memory"]["arena"] > 0 and 0 < a["memory"]["arena_peak"] <= a["memory"]["arena"]
        assert b["memory"]["arena"] == 0
        # After every optimizer step nothing is lent and the free list is one block again.
        assert a["after_steps"] == [(0, 1, 0)] * STEPS
    assert with_arena[0]["state"].keys() == without[0]["state"].keys()
    for name, value in with_arena[0]["state"].items():
        assert torch.equal(value, without[0]["state"][name]), name


def _block_sizes() -> dict[str, int]:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3},
        },
    )
    units = eng._stage.units
    out = {
        "root": sum(g.layout.padded_numel for g in units[0].groups),
        "block": max(sum(g.layout.padded_numel for g in u.groups) for u in units[1:]),
        "all_bytes": 2 * 4 * sum(g.layout.padded_numel for u in units for g in u.groups),
    }  # gathered + buckets
    eng.destroy()
    return out


def test_auto_size_is_bounded_by_max_live_parameters_and_suffices() -> None:
    sizes = run_distributed(_block_sizes, 1)[0]
    limits = {"stage3_max_live_parameters": sizes["root"] + 2 * sizes["block"], "stage3_param_persistence_threshold": 0}
    bounded = run_distributed(_train, 2, args=({**limits, "stage3_arena_bytes": "auto"}, "fp32"))
    reference = run_distributed(_train, 2, args=({**limits, "stage3_arena_bytes": 0}, "fp32"))
    # Below every unit gathered plus every gradient bucket (what an unbounded model would get), and it
    # sufficed: the run trained exactly as without an arena.
    assert 0 < bounded[0]["memory"]["arena_peak"] <= bounded[0]["memory"]["arena"] < sizes["all_bytes"]
    assert bounded[0]["losses"] == reference[0]["losses"]


def test_torch_fallback_arena_trains_the_same() -> None:
    auto = {"stage3_arena_bytes": "auto"}
    compiled = run_distributed(_train, 2, args=(auto, "fp32"), env={"ZERO_ENGINE_OPS": "require"})
    fallback = run_distributed(_train, 2, args=(auto, "fp32"), env={"ZERO_ENGINE_OPS": "fallback"})
    assert compiled[0]["compiled"] is True and fallback[0]["compiled"] is False
    assert compiled[0]["losses"] == fallback[0]["losses"]
    assert compiled[0]["memory"]["arena_peak"] == fallback[0]["memory"]["arena_peak"]


def _too_small() -> str:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_arena_bytes": 1024},
        },
    )
    x, _y = batches(1, MICRO)[0]
    try:
        eng(x)
    except RuntimeError as err:
        return str(err)
    finally:
        eng.destroy()
    return "no error"


def test_too_small_an_arena_is_a_named_error() -> None:
    for rank, message in enumerate(run_distributed(_too_small, 2)):
        assert f"rank {rank}, gathering stage-3 unit" in message
        assert "capacity 1024 bytes" in message
        assert "Raise zero_optimization.stage3_arena_bytes" in message and "stage3_arena_bytes = 0" in message


def _in_use_after_forward(linear: bool) -> dict[str, Any]:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {
                "stage": 3,
                "memory_efficient_linear": linear,
                "stage3_arena_bytes": "auto",
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 0,
                "stage3_param_persistence_threshold": 0,
            },
        },
    )
    units = eng._stage.units
    out: dict[str, Any] = {
        "root": 4 * sum(g.layout.padded_numel for g in units[0].groups),
        "block": 4 * max(sum(g.layout.padded_numel for g in u.groups) for u in units[1:]),
        "losses": [],
    }
    for step, (x, y) in enumerate(batches(3, MICRO)):
        loss = torch.nn.functional.mse_loss(eng(x), y)
        if step == 2:
            out["in_use"] = eng._stage._memory.arena.stats()["in_use"]
        eng.backward(loss)
        eng.step()
        out["losses"].append(loss.item())
    out["state"] = eng._stage.consolidated_state_dict()
    eng.destroy()
    return out


def test_memory_efficient_linear_frees_released_units_before_backward() -> None:
    """Autograd's linear saves weight.t(), a view that keeps a released unit's gathered buffer alive
    until its backward; with memory_efficient_linear (the default) only the root and the last block
    (whose backward comes next) stay gathered between forward and backward, and training is the same."""
    on = run_distributed(_in_use_after_forward, 2, args=(True,))[0]
    off = run_distributed(_in_use_after_forward, 2, args=(False,))[0]
    assert on["in_use"] <= on["root"] + on["block"] + 128 < on["root"] + 2 * on["block"]
    # Without it each block's linear weight group stays in use, held by a saved weight.t().
    assert off["in_use"] >= off["root"] + (BLOCKS - 1) * 4 * WIDTH * WIDTH
    torch.testing.assert_close(on["losses"], off["losses"], rtol=1e-6, atol=0)
    for name, value in on["state"].items():
        torch.testing.assert_close(value, off["state"][name], rtol=1e-5, atol=1e-6)
