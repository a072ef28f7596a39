"""Stage 3 with its memory arena (engine/zero/stage3/memory.py) on real processes over gloo: the same
training as without it, bitwise; every block back in one free block after each step (no
fragmentation); a bounded auto size under stage3_max_live_parameters; the compiled arena and its
torch fallback alike; an explicit size too small for the peak serves what fits and leaves the rest to
the default allocator, training the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from log_records import EngineWarnings
from models import TiedBlocks
from test_stage3 import LR, MICRO, WIDTH, batches, param_groups

import engine

STEPS = 4
BLOCKS = 8  # enough units that a bound under stage3_max_live_parameters is below the whole model


def make_net(seed: int) -> TiedBlocks:
    torch.manual_seed(seed)
    return TiedBlocks(BLOCKS, WIDTH)


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
    state = eng.consolidated_state_dict()
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


def _small_arena(capacity: int) -> dict[str, Any]:
    """_train with an arena of `capacity` bytes, and the warnings the engine logged on this rank."""
    fallbacks: list[int] = []
    destroy = engine.Engine.destroy

    def counted_destroy(self: Any) -> None:  # the count, read before destroy drops the stage
        fallbacks.append(self._stage._memory.fallbacks)
        destroy(self)

    engine.Engine.destroy = counted_destroy  # type: ignore[method-assign]
    try:
        with EngineWarnings() as warnings:
            out = _train({"stage3_arena_bytes": capacity}, "fp32")
    finally:
        engine.Engine.destroy = destroy  # type: ignore[method-assign]
    return out | {"warnings": warnings.messages, "fallbacks": fallbacks[0]}


def test_too_small_an_arena_falls_back_to_the_default_allocator() -> None:
    """A request no free block can hold comes from the default allocator, logged once per rank with the
    arena's numbers and the key: the run trains bitwise as without an arena (it was a RuntimeError)."""
    block = run_distributed(_block_sizes, 1)[0]["block"] * 4
    small = run_distributed(_small_arena, 2, args=(2 * block,))  # a unit and a bucket: not the peak
    without = run_distributed(_train, 2, args=({}, "fp32"))
    for rank, (got, want) in enumerate(zip(small, without)):
        assert got["losses"] == want["losses"]
        assert got["fallbacks"] > 0, got["fallbacks"]  # the arena did run out, on every rank
        arena_peak = got["memory"]["arena_peak"]
        assert got["memory"]["arena"] == 2 * block and 0 < arena_peak <= 2 * block  # and served what fit
        found = [m for m in got["warnings"] if "do not fit in the arena" in m]
        assert len(found) == 1, got["warnings"]  # once, however many fall back
        assert f"rank {rank}, " in found[0] and f"capacity {2 * block} bytes" in found[0], found[0]
        assert "raise zero_optimization.stage3_arena_bytes" in found[0], found[0]
    for name, value in small[0]["state"].items():
        assert torch.equal(value, without[0]["state"][name]), name


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
    out["state"] = eng.consolidated_state_dict()
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
