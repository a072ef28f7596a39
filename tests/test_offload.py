"""ZeRO-Offload (offload_optimizer.device "cpu") against the same run without offload, on real processes.

The offloaded step is one fused Adam pass (engine/ops/adam.py) with the averaging/unscale/clip
coefficient folded in and, at stages 1-2 in bf16, the bf16 parameter shard written in the same pass;
the non-offloaded step multiplies the shards, runs torch's AdamW and casts. fp32 results agree to
float rounding; the tests also check that the fused path really ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed
from models import global_batches, make_model, rank_micro_batch

import engine
from engine.config import ConfigError

STEPS, MICRO, GAS = 12, 2, 2


def _train(stage: int, offload: bool, bf16: bool, optimizer: str) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model(3)
    # Small buckets: stage 1/2 shards span several buckets, so the bf16 shard the fused step writes is a
    # strided (buckets, slice) view of the parameter buffer (the main job's case).
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 200}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    eng, *_ = engine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.1,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "bf16": {"enabled": bf16},
            "zero_optimization": zero,
        },
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    for batch in global_batches(STEPS, MICRO * GAS * ws):
        for k in range(GAS):
            x, y = rank_micro_batch(batch, rank, ws, MICRO, k)
            eng.backward(torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y))
            eng.step()
    fused = eng._stage.master_step.fused_steps
    state = eng.consolidated_state_dict() if stage == 3 else {k: v.clone() for k, v in model.state_dict().items()}
    eng.destroy()
    return {"state": {k: v.float() for k, v in state.items()}, "fused": fused}


@pytest.mark.parametrize(
    "stage,ops", [(1, "require"), (2, "require"), (3, "require"), (2, "fallback"), (3, "fallback")]
)
def test_offload_equals_the_run_without_it_fp32(stage: int, ops: str) -> None:
    # Both paths of the extension (ZERO_ENGINE_OPS in the ranks): the compiled fused ops (Adam, the
    # norm, stage 3's gather cast) and their torch fallbacks give the same training.
    env = {"ZERO_ENGINE_OPS": ops}
    off = run_distributed(_train, 2, args=(stage, True, False, "AdamW"), env=env)[0]
    on = run_distributed(_train, 2, args=(stage, False, False, "AdamW"), env=env)[0]
    assert off["fused"] == STEPS, "every step went through the fused offload kernel"
    for name, want in on["state"].items():
        torch.testing.assert_close(off["state"][name], want, atol=2e-6, rtol=0, msg=name)


@pytest.mark.parametrize("stage,optimizer", [(2, "Adam"), (3, "AdamW")])
def test_offload_bf16_tracks_the_run_without_it(stage: int, optimizer: str) -> None:
    # bf16 parameters written by the fused pass equal the cast of the same master; the masters differ
    # from torch's only by float rounding, which bf16 forward passes can amplify by a bf16 ulp or so.
    off = run_distributed(_train, 2, args=(stage, True, True, optimizer))[0]
    on = run_distributed(_train, 2, args=(stage, False, True, optimizer))[0]
    assert off["fused"] == STEPS
    for name, want in on["state"].items():
        torch.testing.assert_close(off["state"][name], want, atol=2e-2, rtol=0, msg=name)


def _sgd_offload() -> dict[str, Any]:
    return _train(2, True, True, "SGD")


def test_offload_with_another_optimizer_runs_its_own_step() -> None:
    off = run_distributed(_sgd_offload, 2)[0]
    on = run_distributed(_train, 2, args=(2, False, True, "SGD"))[0]
    assert off["fused"] == 0
    for name, want in on["state"].items():
        torch.testing.assert_close(off["state"][name], want, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs zero_optimization.stage 1, 2 or 3"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, r"offload_optimizer.nvme_path: required"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "partial optimizer offload"),
    ],
)
def test_offload_configs_that_cannot_work_are_refused_by_name(zero: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine.initialize(
            model=make_model(0),
            config={
                "train_batch_size": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": zero,
            },
        )
