"""Stage 3's weight gradients computed straight into their gradient bucket (UnitGradients.slot, used by
engine/zero/stage3/memory_efficient_linear.py), on real processes over gloo: the same training, bit for
bit, as the path that returns a fresh gradient and copies it into the bucket (memory_efficient_linear
off), with a block called twice per forward (one weight, two products: only one may take the slot),
a weight tied across units and gradient accumulation; and the slot really taken."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from test_stage3 import LR, MICRO, batches, make_net, param_groups

import engine

STEPS = 4


def _train(gas: int, linear: bool) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_net(7)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "memory_efficient_linear": linear},
    }
    eng, optimizer, _, _ = engine.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses = []
    for step, batch in enumerate(batches(STEPS, MICRO * gas * ws)):
        for k in range(gas):
            start = (k * ws + rank) * MICRO
            x, y = batch[0][start : start + MICRO], batch[1][start : start + MICRO]
            loss = torch.nn.functional.mse_loss(eng(x, twice=step % 2 == 0), y)
            eng.backward(loss)
            if k == gas - 1:  # the loop shape that steps the returned optimizer itself
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    in_place = eng._stage._grads.in_place
    eng.destroy()
    state = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    return {"losses": losses, "state": state, "in_place": in_place}


@pytest.mark.parametrize("world_size,gas", [(1, 2), (2, 1), (2, 2)])
def test_gradients_into_their_slot_train_bitwise_the_same(world_size: int, gas: int) -> None:
    slot = run_distributed(_train, world_size, args=(gas, True))
    fresh = run_distributed(_train, world_size, args=(gas, False))
    # Arrive in their slot: each weight one product uses, the three blocks' (two when blocks.0 runs twice).
    # A weight two products use (inp's, tied with out; blocks.0's when twice) gets its slot for one of them,
    # and autograd's sum of the two, a new tensor, is copied in.
    in_place = gas * sum(2 if step % 2 == 0 else 3 for step in range(STEPS))
    for rank, (a, b) in enumerate(zip(slot, fresh)):
        assert b["in_place"] == 0
        assert a["in_place"] == in_place, f"rank {rank}: {a['in_place']} gradients computed in their slot"
        assert a["losses"] == b["losses"], f"rank {rank}"
        for name, want in b["state"].items():
            assert torch.equal(a["state"][name], want), f"rank {rank} {name}"


def _hooked() -> list[bool]:
    model = make_net(7)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.blocks[2].lin.weight.register_hook(lambda g: kept.append((g, g.clone())))  # a user's hook keeps it
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3},
    }
    eng, *_ = engine.initialize(model=model, model_parameters=param_groups(model), config=config)
    for x, y in batches(3, MICRO):
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()
    eng.destroy()
    return [torch.equal(g, when_given) for g, when_given in kept]


def test_a_gradient_a_hook_kept_is_not_its_bucket() -> None:
    """A tensor hook may keep the gradient it is given: that one is not lent from the bucket, whose memory
    the reduction and the next backward reuse."""
    (unchanged,) = run_distributed(_hooked, 1)
    assert unchanged == [True, True, True]
