"""torch.distributed.nn's differentiable all_gather and all_to_all on gloo subgroups, after the engine
makes a group (engine/comm/torch_nn_gloo.py repairs torch's rank translation): at world 4, the groups
[0, 1] and [2, 3], as sequence x data parallelism makes them. Without the repair the backward of
all_gather on [2, 3] fails ("Global rank 0 is not part of group"); this is the call transformers'
sequence-parallel loss makes in every backward."""

from __future__ import annotations

from typing import Any

import torch

from engine import comm
from tests.distributed import run_distributed


def _gather_and_exchange() -> dict[str, Any]:
    import torch.distributed.nn.functional as nnf

    groups = [comm.new_group([0, 1], "pair"), comm.new_group([2, 3], "pair")]
    rank = comm.get_rank()
    group, position = groups[rank // 2], rank % 2
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    gathered = nnf.all_gather(x, group=group)
    weights = torch.tensor([2.0, 3.0])  # the same loss on both members: sum of weight_i * member_i
    loss = sum(w * g for w, g in zip(weights, gathered, strict=True))
    loss.backward()
    pieces = [torch.full((1,), float(10 * rank + to)) for to in range(2)]  # piece `to` goes to member `to`
    received = nnf.all_to_all([torch.empty(1), torch.empty(1)], pieces, group=group)
    return {
        "gathered": [float(g) for g in gathered],
        "grad": float(x.grad),
        "expected_grad": 2 * float(weights[position]),  # both members' losses reach x: their gradients sum
        "received": [float(r) for r in received],
    }


def test_all_gather_backward_and_all_to_all_on_gloo_subgroups() -> None:
    for rank, got in enumerate(run_distributed(_gather_and_exchange, 4)):
        first = rank - rank % 2
        assert got["gathered"] == [first + 1.0, first + 2.0]
        assert got["grad"] == got["expected_grad"]
        # member `from` sent 10 * its global rank + my position
        assert got["received"] == [10.0 * (first + member) + rank % 2 for member in range(2)]
