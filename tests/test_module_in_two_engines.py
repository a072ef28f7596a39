"""One module given to a second engine while a stage-3 engine still holds its parameters (TRL's
DPOTrainer(precompute_ref_log_probs=True) at ZeRO-3 does it: an inference engine for the log-prob pass,
kept, then the training engine). The first engine keeps the values in its own shards and leaves the
parameters empty, so the second laid out empty tensors and failed inside torch at its first forward
("'weight' must be 2-D"); now initialize refuses by name, and after destroy() the module trains."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine
from engine.unsupported import UnsupportedFeatureError
from tests.distributed import run_distributed
from tests.models import make_model

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _second_engine(second_stage: int) -> dict[str, Any]:
    model = make_model()
    # No optimizer: an inference engine, as TRL's prepare_deepspeed builds.
    inference, _, _, _ = engine.initialize(model=model, config={k: v for k, v in CONFIG.items() if k != "optimizer"})
    with torch.no_grad():
        before = inference(torch.ones(4, 16)).sum().item()
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], "stage": second_stage}}
    try:
        engine.initialize(model=model, config=config)
    except UnsupportedFeatureError as e:
        refused = str(e)
    else:
        refused = ""
    inference.destroy()  # the module is the first engine's no longer: a second engine takes it
    trained, _, _, _ = engine.initialize(model=model, config=config)
    with torch.no_grad():
        after = trained(torch.ones(4, 16)).sum().item()
    loss = trained(torch.randn(4, 16)).pow(2).mean()
    trained.backward(loss)
    trained.step()
    trained.destroy()
    return {"refused": refused, "before": before, "after": after}


@pytest.mark.parametrize("second_stage", [2, 3])
def test_a_module_held_by_a_live_stage3_engine_is_refused_by_name(second_stage: int) -> None:
    for r in run_distributed(_second_engine, 2, args=(second_stage,)):
        assert "is partitioned by another ZeRO stage 3 engine that is still alive" in r["refused"], r["refused"]
        assert "destroy()" in r["refused"] and "precompute_ref_log_probs=False" in r["refused"]
        assert r["after"] == r["before"]  # the destroyed engine handed the module back whole
