"""ZeRO stage 3 against a single-process reference, on real processes over gloo.

The model has repeated blocks (one gather unit each), a tied input/output weight (in the root unit),
a frozen layer inside a block, two param groups, and optionally runs a block twice per forward.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from distributed import run_distributed
from models import TiedBlocks

import engine

STEPS = 12
MICRO = 4
WIDTH = 16
LR = 1e-2
DECAY = 0.05
ATOL = 1e-5  # fp32: only summation order differs (see test_stage0.py)


class Net(TiedBlocks):
    """Three blocks; the forward's options make a unit run twice, see an input without grad, or sit out."""

    def __init__(self) -> None:
        super().__init__(3, WIDTH)

    def forward(
        self, x: torch.Tensor, twice: bool = False, raw_input: bool = False, skip_block: int | None = None
    ) -> torch.Tensor:
        # raw_input: the first unit sees an input that does not require grad; skip_block: a unit
        # (and its parameters) unused in this step.
        h = x if raw_input else torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            if i != skip_block:
                h = block(h)
        if twice:
            h = self.blocks[0](h)  # a unit called twice in one forward
        return self.out(h)


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in trainable if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]


def batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (torch.randn(global_batch, WIDTH, generator=g), torch.randn(global_batch, WIDTH, generator=g))
        for _ in range(steps)
    ]


def variant(step: int, options: dict[str, Any]) -> dict[str, Any]:
    """Forward keyword arguments of a step for the test's options."""
    return {
        "twice": bool(options.get("twice")),
        "raw_input": bool(options.get("raw_input")),
        "skip_block": 1 if options.get("skip") and step % 2 else None,
    }


def reference(gas: int, ws: int, clip: float, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = make_net(7)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step, (x, y) in enumerate(batches(STEPS, MICRO * gas * ws)):
        loss = torch.nn.functional.mse_loss(model(x, **variant(step, options)), y)
        opt.zero_grad()
        loss.backward()
        for p in trainable:  # ZeRO treats a missing gradient as zero (see test_zero12_features.py)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(gas: int, clip: float, options: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_net(7 + rank)
    if options.get("leaf_api"):
        engine.zero.set_z3_leaf_modules(model, [torch.nn.Linear])  # DeepSpeed's way to name units
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 3},
        **top,
    }
    eng, _, _, _ = engine.initialize(model=model, model_parameters=param_groups(model), config=config)
    dtype = eng._stage.units[0].groups[0].dtype
    empty_between_steps = []
    losses = []
    for step, batch in enumerate(batches(STEPS, MICRO * gas * ws)):
        for k in range(gas):
            start = (k * ws + rank) * MICRO
            x, y = batch[0][start : start + MICRO], batch[1][start : start + MICRO]
            loss = torch.nn.functional.mse_loss(eng(x.to(dtype), **variant(step, options)).float(), y)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        empty_between_steps.append(all(p.numel() == 0 for p in eng.module.parameters()))
    report = eng.memory_report()
    probe = batches(1, 2)[0][0]
    with torch.no_grad():  # evaluation: gathered for forward, released after, no backward
        evaluated = eng(probe.to(dtype), **variant(0, options)).float()
    eng(probe.to(dtype), **variant(0, options))  # a forward with grad enabled and no backward
    gathered_after_eval = eng.memory_report()["gathered"]
    units = [(u.name, sum(g.layout.numel for g in u.groups)) for u in eng._stage.units]
    eng.destroy()  # gives the module back whole
    state = {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()}
    with torch.no_grad():
        whole = eng.module(probe.to(dtype), **variant(0, options)).float()
    return {
        "state": state,
        "empty": empty_between_steps,
        "memory": report,
        "units": units,
        "losses": losses,
        "evaluated": evaluated,
        "whole": whole,
        "gathered_after_eval": gathered_after_eval,
    }


DEFAULT_UNITS = ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def _check(
    results: list[dict[str, Any]], expected: dict[str, torch.Tensor], atol: float, units: list[str] = DEFAULT_UNITS
) -> None:
    for rank, result in enumerate(results):
        assert all(result["empty"]), "outside forward/backward every parameter is released"
        assert [name for name, _ in result["units"]] == units
        assert result["memory"]["gathered"] == 0
        for name, want in expected.items():
            torch.testing.assert_close(result["state"][name], want, atol=atol, rtol=0, msg=f"rank {rank} {name}")
        # no_grad evaluation used the trained parameters and matched the module given back whole.
        torch.testing.assert_close(result["evaluated"], result["whole"], atol=0, rtol=0)


@pytest.mark.parametrize(
    "world_size,gas,collectives",
    [(2, 1, "engine"), (2, 4, "engine"), (4, 1, "engine"), (4, 1, "native"), (4, 1, "ring")],
)
@pytest.mark.parametrize("twice", [False, True])
def test_stage3_matches_single_process(world_size: int, gas: int, collectives: str, twice: bool) -> None:
    clip = 0.05
    options = {"twice": twice}
    # engine: the point-to-point direct exchanges on gloo; ring: the rings; native: torch's collectives.
    env = {"ZERO_ENGINE_COLLECTIVES": collectives}
    results = run_distributed(_train, world_size, args=(gas, clip, options, {}), env=env)
    _check(results, reference(gas, world_size, clip, options), ATOL)


@pytest.mark.parametrize("options", [{"raw_input": True}, {"skip": True}])
def test_stage3_input_without_grad_and_unit_unused_in_a_step(options: dict[str, Any]) -> None:
    results = run_distributed(_train, 2, args=(2, 0.05, options, {}))
    _check(results, reference(2, 2, 0.05, options), ATOL)


@pytest.mark.parametrize("how", ["config", "api"])
def test_stage3_units_named_by_the_user(how: str) -> None:
    # Every Linear a unit: the tied inp/out weight moves to the root with the LayerNorms; "out" keeps
    # no parameter of its own and is no unit.
    options = {"leaf_api": how == "api", "twice": True}
    top = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Linear"]}}} if how == "config" else {}
    results = run_distributed(_train, 2, args=(2, 0.05, options, top))
    _check(
        results,
        reference(2, 2, 0.05, options),
        ATOL,
        units=["<root>", "inp", "blocks.0.lin", "blocks.1.lin", "blocks.2.lin"],
    )


def test_stage3_small_consecutive_blocks_merged_into_one_unit() -> None:
    # Blocks of ~300 elements under a 500-element threshold: blocks 0 and 1 share one unit (one
    # all-gather, one reduce-scatter), block 2 starts the next; block 0 also runs again after block 2.
    options = {"twice": True}
    top = {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 500}}
    results = run_distributed(_train, 2, args=(2, 0.05, options, top))
    _check(results, reference(2, 2, 0.05, options), ATOL, units=["<root>", "blocks.0-1", "blocks.2"])


def test_stage3_bf16_tracks_the_fp32_reference() -> None:
    results = run_distributed(_train, 2, args=(2, 0.05, {}, {"bf16": {"enabled": True}}))
    fp32 = run_distributed(_train, 2, args=(2, 0.05, {}, {}))
    # Adam moves each parameter by about lr per step whatever the gradient's size, so bf16 rounding
    # can cost up to ~lr per step against fp32 (see test_zero12_features.py).
    _check(results, reference(2, 2, 0.05, {}), 4 * LR)
    for got, want in zip(results, fp32):
        assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(got["losses"], want["losses"]))


def test_stage3_memory_and_traffic() -> None:
    result = run_distributed(
        _train_measured,
        2,
        args=(
            {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
        ),
    )[0]
    psi, padded, shard = result["psi"], result["padded"], result["shard"]
    assert result["memory"]["params"] == 4 * shard + result["frozen_shard_bytes"]
    assert result["memory"]["gradients"] == 4 * shard
    assert result["memory"]["optimizer_state"] == 8 * shard
    assert result["memory"]["master"] == 0  # fp32: the shard is the master
    # Without prefetch: the root unit plus at most two blocks (one finishing its backward while the
    # next is gathered) are whole at any time.
    assert result["memory"]["peak_gathered"] <= result["root_bytes"] + 2 * result["max_block_bytes"]
    assert result["prefetched"] == 0
    # Paper 7.2.2: 3 Psi per step (all-gather in forward and in backward, reduce-scatter), except
    # the root unit and the last block, which stay gathered from their forward to their backward.
    step = result["comm"]
    assert step["reduce_scatter"] == pytest.approx(0.5 * padded * 4, abs=16)
    gathered_twice = 2 * (result["all_padded"] - result["root_padded"]) + result["root_padded"] - result["last_padded"]
    assert step["all_gather"] == pytest.approx(0.5 * gathered_twice * 4, abs=16)
    assert padded - psi < 8 * 2 * 32


def test_stage3_units_reused_within_max_reuse_distance_stay_gathered() -> None:
    # DeepSpeed's default reuse distance (1e9 elements) spans this whole model: each unit is gathered
    # once per step and kept from its forward to its backward (2 Psi per step, all of it gathered).
    kept = run_distributed(_train_measured, 2, args=({"stage3_param_persistence_threshold": 0},))[0]
    assert kept["comm"]["all_gather"] == pytest.approx(0.5 * kept["all_padded"] * 4, abs=16)
    assert kept["memory"]["peak_gathered"] == 4 * kept["all_padded"]
    assert kept["order_changes"] == 0 and kept["prefetched"] > 0
    # A distance of one block: block i's next use (its backward) comes after the blocks above it, so
    # only the last two blocks are kept; the first is gathered again for its backward.
    one = run_distributed(
        _train_measured,
        2,
        args=({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": kept["block_numel"]},),
    )[0]
    assert one["comm"]["all_gather"] == pytest.approx(0.5 * (one["all_padded"] + one["first_padded"]) * 4, abs=16)
    assert one["order_changes"] == 0


def _train_measured(zero: dict[str, Any], skip: bool = False) -> dict[str, Any]:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, **zero},
        },
    )
    for step, (x, y) in enumerate(batches(4, MICRO)):
        eng.backward(torch.nn.functional.mse_loss(eng(x, skip_block=1 if skip and step == 2 else None), y))
        eng.step()
    units = eng._stage.units
    trainable = [g for u in units for g in u.trainable]
    frozen = [g for u in units for g in u.groups if g.opt_group is None]
    out = {
        "memory": eng.memory_report(),
        "comm": eng.comm_stats()["last_step"]["bytes_sent"],
        "psi": sum(g.layout.numel for g in trainable),
        "padded": sum(g.layout.padded_numel for g in trainable),
        "shard": sum(g.layout.slice_numel for g in trainable),
        "frozen_shard_bytes": sum(4 * g.layout.slice_numel for g in frozen),
        "all_padded": sum(g.layout.padded_numel for u in units for g in u.groups),
        "root_padded": sum(g.layout.padded_numel for g in units[0].groups),
        "root_bytes": 4 * sum(g.layout.padded_numel for g in units[0].groups),
        "max_block_bytes": max(4 * sum(g.layout.padded_numel for g in u.groups) for u in units[1:]),
        "last_padded": sum(g.layout.padded_numel for g in units[-1].groups),
        "first_padded": sum(g.layout.padded_numel for g in units[1].groups),
        "block_numel": max(sum(g.layout.padded_numel for g in u.groups) for u in units[1:]),
        "prefetched": eng._stage.prefetched_gathers,
        "order_changes": eng._stage.order_changes,
    }
    eng.destroy()
    return out


def _gathered_parameters(stage: int) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage},
        },
    )
    for x, y in batches(2, MICRO):
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()
    weight = eng.module.blocks[0].lin.weight
    out: dict[str, Any] = {"outside": tuple(weight.shape)}
    with engine.zero.GatheredParameters([weight, eng.module.out.weight]):
        out["inside"] = tuple(weight.shape)
        out["value"] = weight.detach().clone()
        out["tied_inside"] = tuple(eng.module.inp.weight.shape)
    out["after"] = tuple(weight.shape)
    with engine.zero.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    full = eng.consolidated_state_dict()
    out["keys"] = list(full)
    out["modified"] = full["blocks.0.lin.weight"].clone() if full else None
    out["tied_equal"] = bool(full) and torch.equal(full["inp.weight"], full["out.weight"])
    x, y = batches(1, MICRO)[0]
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))  # training goes on from the modified weight
    eng.step()
    eng.destroy()
    out["final"] = eng.module.blocks[0].lin.weight.detach().clone()
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_gathered_parameters_and_consolidated_state_dict(stage: int) -> None:
    results = run_distributed(_gathered_parameters, 2, args=(stage,))
    full = (WIDTH, WIDTH)
    for rank, result in enumerate(results):
        assert result["outside"] == ((0,) if stage == 3 else full)
        assert result["inside"] == full and result["tied_inside"] == full
        assert result["after"] == result["outside"]
        torch.testing.assert_close(result["value"], results[0]["value"], atol=0, rtol=0)
        # rank 0's modification reached every rank's shard: one more step moved it by about lr only.
        assert (result["final"] - 0.5).abs().max() < 2 * LR
    assert results[0]["modified"] is not None and bool((results[0]["modified"] == 0.5).all())
    assert results[0]["keys"] == list(make_net(0).state_dict())
    assert results[0]["tied_equal"]
    assert results[1]["keys"] == []


def test_stage3_prefetch_within_max_live_parameters_and_order_changes() -> None:
    probe = run_distributed(_train_measured, 1, args=({},))[0]
    root, block = probe["root_padded"], probe["block_numel"]
    max_live = root + 2 * block  # room for the root and two blocks, not all three
    result = run_distributed(
        _train_measured, 2, args=({"stage3_max_live_parameters": max_live, "stage3_param_persistence_threshold": 0},)
    )[0]
    assert result["prefetched"] > 0, "later steps prefetch along the recorded order"
    assert result["order_changes"] == 0
    # + the prefetch that crosses the limit (DeepSpeed's rule) + one on-demand gather
    assert result["memory"]["peak_gathered"] <= 4 * (max_live + 2 * block)
    # A step that skips a block changes the order: gathers fall back to on demand, then re-record.
    changed = run_distributed(_train_measured, 2, args=({"stage3_param_persistence_threshold": 0}, True))[0]
    assert changed["order_changes"] >= 1 and changed["prefetched"] > 0


GPT_STEPS = 6
# The attention key bias has a true gradient of exactly zero (softmax ignores a constant added to
# every key), so its gradient is summation-order noise (~1e-9), which Adam with eps 1e-8 would turn
# into lr-sized steps that differ between any two summation orders. eps 1e-4 leaves the real
# gradients (1e-3 and up) alone and keeps the noise negligible.
GPT_EPS = 1e-4


def _gpt(seed: int) -> torch.nn.Module:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))


def _gpt_batches(global_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 32, (global_batch, 9), generator=g) for _ in range(GPT_STEPS)]


def _train_gpt(built_partitioned: bool) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Under engine.zero.Init every module is partitioned as it is built (GPT's self.apply(init) runs
    # after its children were partitioned); rank 0's initialisation wins either way.
    with engine.zero.Init(enabled=built_partitioned):
        model = _gpt(11 + rank)
    assert all(p.numel() == 0 for p in model.parameters()) == built_partitioned
    eng, *_ = engine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": GPT_EPS}},
            "zero_optimization": {"stage": 3},
        },
    )
    units = [u.name for u in eng._stage.units]
    for batch in _gpt_batches(2 * 2 * ws):
        for k in range(2):
            rows = batch[(k * ws + rank) * 2 : (k * ws + rank + 1) * 2]
            eng.backward(eng(rows[:, :-1], rows[:, 1:]))
            eng.step()
    eng.destroy()
    return {"units": units, "state": {k: v.detach().clone() for k, v in eng.module.state_dict().items()}}


@pytest.mark.parametrize("built_partitioned", [False, True], ids=["plain", "zero.Init"])
def test_stage3_gpt_of_the_main_job_matches_single_process(built_partitioned: bool) -> None:
    results = run_distributed(_train_gpt, 2, args=(built_partitioned,))
    model = _gpt(11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=GPT_EPS, weight_decay=0.0)  # DeepSpeed's decay: 0
    for batch in _gpt_batches(8):
        opt.zero_grad()
        model(batch[:, :-1], batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    for result in results:
        assert result["units"] == ["<root>", "blocks.0", "blocks.1"]
        for name, want in model.state_dict().items():
            torch.testing.assert_close(result["state"][name], want, atol=ATOL, rtol=0, msg=name)


def test_stage3_units_below_the_persistence_threshold_are_gathered_once_per_step() -> None:
    result = run_distributed(_train_measured, 2, args=({"stage3_param_persistence_threshold": 10**9},))[0]
    # Every unit stays whole from its forward to its backward: one all-gather of everything per step.
    assert result["comm"]["all_gather"] == pytest.approx(0.5 * result["all_padded"] * 4, abs=16)


def _diverging_ranks() -> None:
    rank = torch.distributed.get_rank()
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    for step, (x, y) in enumerate(batches(3, MICRO)):
        skip = 1 if step == 1 and rank == 1 else None  # rank-divergent control flow
        eng.backward(torch.nn.functional.mse_loss(eng(x, skip_block=skip), y))
        eng.step()


@pytest.mark.parametrize("native", [False, True])
def test_diverging_ranks_fail_fast_naming_the_collective_instead_of_hanging(native: bool) -> None:
    # The engine's gloo collectives compare signatures first: an error naming both ranks' collectives
    # at once (a long timeout proves it is not the timeout). torch's own can only time out.
    env = {"ZERO_ENGINE_COLLECTIVE_TIMEOUT": "3" if native else "50"}
    if native:
        env["ZERO_ENGINE_NATIVE_COLLECTIVES"] = "1"
    with pytest.raises(RuntimeError) as info:
        run_distributed(_diverging_ranks, 2, timeout=45, env=env)
    message = str(info.value)
    assert "stage-3 unit" in message and "optimizer step 2" in message, message
    if native:
        assert "did not complete within 3 s" in message, message
    else:
        assert re.search(
            r"rank \d issued (reduce_scatter|all_gather)\(numel=\d+, float32, key=\d+\) as its collective "
            r"#\d+ but rank \d issued (reduce_scatter|all_gather)",
            message,
        ), message


def test_a_leaf_module_config_that_matches_nothing_is_refused() -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"zero_optimization.leaf_module .*Conv2d.* matches no submodule of Net"):
        engine.initialize(
            model=make_net(0),
            config={
                "train_batch_size": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Conv2d"]}},
            },
        )


def _read_released_parameters() -> dict[str, Any]:
    import warnings

    from engine.zero.released import ReleasedParameterWarning

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(2, MICRO):  # training, evaluation and metadata reads never warn
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            eng.step()
        with torch.no_grad():
            eng(x)
        shapes = [(tuple(p.shape), p.ds_shape, p.numel(), p.requires_grad) for p in model.parameters()]
        quiet = [str(w.message) for w in caught]
        total = model.blocks[1].lin.weight.sum()  # user code reading a released parameter
        model.blocks[2].lin.weight.mean()  # a second read: the warning was once per process
        with engine.zero.GatheredParameters(model.blocks[1].lin.weight):
            whole = model.blocks[1].lin.weight.sum()
        warned = [(w.category is ReleasedParameterWarning, str(w.message)) for w in caught[len(quiet) :]]
    eng.destroy()
    return {"quiet": quiet, "warned": warned, "shapes": shapes, "empty_sum": float(total), "whole": float(whole)}


def test_reading_a_released_parameter_warns_once_naming_it() -> None:
    result = run_distributed(_read_released_parameters, 2)[0]
    assert result["quiet"] == []
    assert all(shape == (0,) and numel == 0 and len(full) >= 1 for shape, full, numel, _ in result["shapes"])
    assert len(result["warned"]) == 1, result["warned"]
    is_ours, message = result["warned"][0]
    assert is_ours and "'blocks.1.lin.weight'" in message and "GatheredParameters" in message
    assert result["empty_sum"] == 0.0 and result["whole"] != 0.0


def _save_16bit(stage: int, gather_on_save: bool, directory: str) -> dict[str, Any]:
    model = make_net(7)
    eng, *_ = engine.initialize(
        model=model,
        model_parameters=param_groups(model),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": gather_on_save},
        },
    )
    x, y = batches(1, MICRO)[0]
    eng.backward(torch.nn.functional.mse_loss(eng(x.bfloat16()).float(), y))
    eng.step()
    saved = eng.save_16bit_model(directory, "model.pt")
    full = eng.consolidated_state_dict()
    eng.destroy()
    return {"saved": saved, "full": full}


@pytest.mark.parametrize("stage,gather_on_save", [(3, True), (3, False), (2, False)])
def test_save_16bit_model(stage: int, gather_on_save: bool, tmp_path: Any) -> None:
    results = run_distributed(_save_16bit, 2, args=(stage, gather_on_save, str(tmp_path)))
    expected = stage != 3 or gather_on_save  # DeepSpeed: stage 3 saves only with the gather flag
    assert [r["saved"] for r in results] == [expected, expected]
    if not expected:
        assert not (tmp_path / "model.pt").exists()
        return
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(state) == list(make_net(0).state_dict()) and list(tmp_path.iterdir()) == [tmp_path / "model.pt"]
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, results[0]["full"][name]), name


def _deep_bucket_memory() -> dict[str, int]:
    torch.manual_seed(0)
    # 16 block units, and a root unit (the two wide layers) larger than any block, so pooled buffers
    # of a block's size must not be handed out for the root's gradients.
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 8 * WIDTH),
        torch.nn.Linear(8 * WIDTH, WIDTH),
        torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(16))),
    )
    eng, *_ = engine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    for x, y in batches(3, MICRO):
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()
    units = eng._stage.units
    out = {
        "buckets": eng.memory_report()["buckets"],
        "root_bytes": 4 * sum(g.layout.padded_numel for g in units[0].groups),
        "block_bytes": max(4 * sum(g.layout.padded_numel for g in u.groups) for u in units[1:]),
        "all_bytes": sum(4 * g.layout.padded_numel for u in eng._stage.units for g in u.groups),
    }
    eng.destroy()
    return out


def test_stage3_gradient_buckets_are_recycled_not_one_per_unit() -> None:
    from engine.zero.stage3.grads import MAX_REDUCES_IN_FLIGHT

    result = run_distributed(_deep_bucket_memory, 2)[0]
    # A few blocks' worth (reductions in flight + the unit collecting gradients) and the root's own
    # buffer, not one per unit.
    bound = result["root_bytes"] + (MAX_REDUCES_IN_FLIGHT + 2) * result["block_bytes"]
    assert result["buckets"] <= bound < result["all_bytes"], result
