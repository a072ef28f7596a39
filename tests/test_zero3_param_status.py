"""DeepSpeed's per-parameter stage-3 surface that clients read: `param.ds_status` (TRL gathers only the
parameters not AVAILABLE), `ZeroParamStatus` in partition_parameters, and `param.partition_numel()`
(Lightning's model summary). AttributeError before."""

from __future__ import annotations

from typing import Any

import torch

import engine
from engine.zero import partitioned_init
from tests.distributed import run_distributed
from tests.models import make_model


def _statuses() -> dict[str, Any]:
    status = partitioned_init.ZeroParamStatus  # deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    eng, _, _, _ = engine.initialize(model=make_model(), config=config)
    last = eng.module.layers[-1].weight
    during_first_layer: list[Any] = []
    eng.module.layers[0].register_forward_hook(lambda *_: during_first_layer.append(last.ds_status))
    for _ in range(3):
        eng.backward(eng(torch.randn(4, 16)).pow(2).mean())
        eng.step()
    params = list(eng.module.parameters())
    outside = {p.ds_status for p in params}
    with engine.zero.GatheredParameters(params):
        inside = {p.ds_status for p in params}
    out = {
        "outside": outside,
        "inside": inside,
        "during": during_first_layer,
        "status": status,
        "partition": [p.partition_numel() for p in params],
        "numel": [p.ds_numel for p in params],
    }
    eng.destroy()
    return out


def test_ds_status_follows_the_unit_and_partition_numel_splits_each_parameter() -> None:
    ranks = run_distributed(_statuses, 2)
    status = ranks[0]["status"]
    for r in ranks:
        assert r["outside"] == {status.NOT_AVAILABLE} and r["inside"] == {status.AVAILABLE}
        # The first step records the order, later ones prefetch the last layer while the first runs.
        assert r["during"][0] is status.NOT_AVAILABLE and set(r["during"][1:]) == {status.INFLIGHT}, r["during"]
    # Every element is stored on exactly one rank.
    assert [a + b for a, b in zip(ranks[0]["partition"], ranks[1]["partition"])] == ranks[0]["numel"]
