"""Stage 0 (replicated, bucketed all-reduce) against a single-process reference, on real processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine
from distributed import run_distributed
from models import global_batches, make_model, rank_micro_batch, reference_train

STEPS = 20
MICRO = 4
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}

# fp32 tolerance: the only difference from the reference is summation order (the all-reduce
# adds per-rank partial means; the reference sums one big batch), ~1e-7 relative per step.
# Over 20 Adam steps that stays below ~2e-6 absolute; 1e-5 leaves margin and still catches any
# wrong scaling (a missing 1/N or 1/gas moves parameters by ~1e-2).
ATOL = 1e-5


def _config(gas: int, clip: float, **extra: Any) -> dict[str, Any]:
    zero = {"stage": 0, "reduce_bucket_size": 100}  # ~3 buckets for the MLP: exercises bucketing
    zero.update(extra.pop("zero", {}))
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": OPTIMIZER,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": zero,
        **extra,
    }


def _train_engine(gas: int, clip: float, extra: dict[str, Any]) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model(seed=100 + rank)  # different per rank: initialize must broadcast rank 0's
    eng, _, _, _ = engine.initialize(model=model, config=_config(gas, clip, **dict(extra)))
    batches = global_batches(STEPS, MICRO * gas * ws)
    norms = []
    for batch in batches:
        for k in range(gas):
            x, y = rank_micro_batch(batch, rank, ws, MICRO, k)
            loss = torch.nn.functional.mse_loss(eng(x), y)
            eng.backward(loss)
            eng.step()
        norms.append(eng.get_global_grad_norm())
    out = {
        "state": {k: v.detach().clone() for k, v in eng.module.state_dict().items()},
        "global_steps": eng.global_steps,
        "global_samples": eng.global_samples,
        "micro_steps": eng.micro_steps,
        "norms": norms,
        "launched_from_hooks": eng._stage.launched_from_hooks,
        "buckets": len(eng._stage.buckets),
    }
    eng.destroy()
    return out


def _assert_matches_reference(results: list[dict[str, Any]], gas: int, clip: float, ws: int) -> None:
    batches = global_batches(STEPS, MICRO * gas * ws)
    reference = reference_train(batches, OPTIMIZER, clip, seed=100)
    for rank, result in enumerate(results):
        assert result["global_steps"] == STEPS
        assert result["global_samples"] == STEPS * MICRO * gas * ws
        assert result["micro_steps"] == STEPS * gas
        for name, expected in reference.items():
            torch.testing.assert_close(
                result["state"][name], expected, atol=ATOL, rtol=0, msg=lambda m: f"rank {rank} {name}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("gas,clip", [(1, 0.0), (2, 0.0), (1, 0.05), (2, 0.05)])
def test_stage0_matches_single_process(world_size: int, gas: int, clip: float) -> None:
    results = run_distributed(_train_engine, world_size, args=(gas, clip, {}))
    _assert_matches_reference(results, gas, clip, world_size)
    if clip:
        # The clip threshold is below the real norms, so clipping really happened.
        assert max(results[0]["norms"]) > clip


def test_stage0_world_size_1_matches_reference() -> None:
    results = run_distributed(_train_engine, 1, args=(2, 0.05, {}))
    _assert_matches_reference(results, 2, 0.05, 1)


@pytest.mark.parametrize(
    "extra",
    [{"prescale_gradients": True}, {"gradient_predivide_factor": 2.0}, {"zero": {"reduce_bucket_size": 10_000}}],
)
def test_stage0_scaling_options_and_one_bucket_match_reference(extra: dict[str, Any]) -> None:
    results = run_distributed(_train_engine, 2, args=(2, 0.0, extra))
    _assert_matches_reference(results, 2, 0.0, 2)


def test_stage0_reduction_overlaps_backward() -> None:
    # With several buckets, all but the one completed last by backward's final gradient are
    # launched from gradient hooks while backward is still running.
    result = run_distributed(_train_engine, 2, args=(1, 0.0, {}))[0]
    assert result["buckets"] >= 3
    assert result["launched_from_hooks"] >= (result["buckets"] - 1) * STEPS


def _ranks_start_identical() -> list[torch.Tensor]:
    rank = torch.distributed.get_rank()
    model = make_model(seed=7 + rank)
    model.scale.fill_(float(rank))  # buffers are broadcast too
    eng, _, _, _ = engine.initialize(model=model, config=_config(1, 0.0))
    tensors = [t.detach().clone() for t in eng.module.state_dict().values()]
    eng.destroy()
    return tensors


def test_initialize_broadcasts_rank0_state() -> None:
    ranks = run_distributed(_ranks_start_identical, 4)
    expected = make_model(seed=7).state_dict()
    for tensors in ranks:
        for got, (name, want) in zip(tensors, expected.items()):
            if name == "scale":
                assert torch.equal(got, torch.zeros_like(want))
            else:
                assert torch.equal(got, want)


def _no_sync_accumulation() -> dict[str, torch.Tensor]:
    # gradient_accumulation_steps 1, accumulation managed with no_sync (the Accelerate pattern):
    # two micro-batches inside no_sync, the last one outside; equals gas=3 on the same batches.
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    eng, _, _, _ = engine.initialize(
        model=make_model(seed=100), config={**_config(1, 0.0), "train_micro_batch_size_per_gpu": MICRO}
    )
    for batch in global_batches(5, MICRO * 3 * ws):
        for k in range(3):
            x, y = rank_micro_batch(batch, rank, ws, MICRO, k)
            loss = torch.nn.functional.mse_loss(eng(x), y) / 3
            if k < 2:
                with eng.no_sync():
                    eng.backward(loss)
            else:
                eng.backward(loss)
                eng.step()
    state = {k: v.clone() for k, v in eng.module.state_dict().items()}
    eng.destroy()
    return state


def test_no_sync_accumulates_locally_and_reduces_once() -> None:
    results = run_distributed(_no_sync_accumulation, 2)
    reference = reference_train(global_batches(5, MICRO * 3 * 2), OPTIMIZER, 0.0, seed=100)
    for state in results:
        for name, expected in reference.items():
            torch.testing.assert_close(state[name], expected, atol=ATOL, rtol=0)


class _PartlyUsed(torch.nn.Module):
    """`branch` is used only on rank 0 and `frozen` never trains: neither may hang or diverge."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.frozen(self.trunk(x))
        return self.branch(h) if use_branch else h


def _unused_on_one_rank() -> list[torch.Tensor]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(
        model=_PartlyUsed(),
        config={
            "train_batch_size": 8,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 64},
            "steps_per_print": 1000,
        },
    )
    frozen_before = eng.module.frozen.weight.detach().clone()
    for step in range(3):
        x = torch.full((4, 8), float(rank + step))
        eng.backward(eng(x, use_branch=(rank == 0)).pow(2).mean())
        eng.step()
    assert torch.equal(eng.module.frozen.weight, frozen_before)
    params = [p.detach().clone() for p in eng.module.parameters()]
    eng.destroy()
    return params


def test_parameter_unused_on_one_rank_and_frozen_parameters() -> None:
    rank0, rank1 = run_distributed(_unused_on_one_rank, 2, timeout=60)
    for a, b in zip(rank0, rank1):
        assert torch.equal(a, b)  # replicas stay identical: the branch gradient is averaged with zeros


def _two_boundary_backwards() -> str:
    eng, _, _, _ = engine.initialize(model=make_model(), config=_config(1, 0.0))
    x = torch.randn(MICRO, 16)
    eng.backward(eng(x).sum())
    try:
        eng.backward(eng(x).sum())
    except RuntimeError as err:
        return str(err)
    finally:
        eng.destroy()
    return "no error"


def test_second_backward_at_a_boundary_is_refused_clearly() -> None:
    message = run_distributed(_two_boundary_backwards, 2)[0]
    assert "already reduced" in message and "engine.step()" in message
