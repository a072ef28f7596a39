"""PyTorch Lightning (Trainer and Fabric) trains on the engine through its own DeepSpeedStrategy, with the
real lightning from the test extra and the `deepspeed` distribution built from compat/deepspeed
(tests/hf_clients.py installs it), 2 ranks on CPU over gloo. Lightning refuses DeepSpeed off CUDA with
two checks of its own; tests/lightning_scripts/cpu_deepspeed.py lifts exactly those, as a CPU user must.

Two launches (one per client, each running every configuration in turn, see the scripts' docstrings),
each compared with the same client's DDP strategy in the same launch: same seed, same data on each rank,
same global batch. fp32 runs match DDP within fp32 rounding (rtol 1e-5 over 8 AdamW steps: the
gradient average is summed in another order; most runs are bitwise equal). bf16 runs ("bf16-mixed":
Lightning casts inputs to bf16, the engine computes in bf16 with fp32 masters) match fp32 DDP within
rtol 1e-2: bf16 keeps 8 significant bits (unit roundoff 2**-9, 2e-3), so a loss computed through two
bf16 layers from bf16 weights differs from fp32 by a few roundoffs (measured: at most 2.6e-3 over
these 8 steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_clients import ROOT, client_env, run_script

SCRIPTS = ROOT / "tests" / "lightning_scripts"
FP32, BF16 = 1e-5, 1e-2
STEPS = 8


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


def launch(script: str, env: dict[str, str], out: Path) -> dict[str, Any]:
    run_script(SCRIPTS / script, [str(out)], 2, env, out, timeout=300)
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def trainer(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("lightning_trainer")
    return launch("trainer_run.py", env, out), out


@pytest.fixture(scope="module")
def fabric(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch("fabric_run.py", env, tmp_path_factory.mktemp("lightning_fabric"))


def assert_losses(got: list[list[float]], want: list[list[float]], rtol: float, steps: int = STEPS) -> None:
    """Per rank, per step (each rank sees its own batches)."""
    assert [len(r) for r in got] == [steps, steps]
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)


def max_rel_delta(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(a - b) / abs(b) for ra, rb in zip(got, want) for a, b in zip(ra, rb))


def test_trainer_stages_equal_ddp(trainer: tuple[dict[str, Any], Path]) -> None:
    """Stage 1 (Lightning's default DeepSpeed config), stage 3 (a config dict, every parameter partitioned,
    built under zero.Init in configure_model, resumed halfway), both with gradient_clip_val; stage 2 with
    accumulate_grad_batches=2 against DDP with the same accumulation."""
    losses = trainer[0]["losses"]
    assert_losses(losses["stage1"], losses["ddp"], FP32)
    assert_losses(losses["stage3"], losses["ddp"], FP32)
    assert_losses(losses["stage2_gas2"], losses["ddp_gas2"], FP32)
    assert max_rel_delta(losses["ddp_gas2"], losses["ddp"]) > 1e-2  # accumulation changed the run


def test_trainer_validate_builds_an_inference_engine(trainer: tuple[dict[str, Any], Path]) -> None:
    val = trainer[0]["val_loss"]
    torch.testing.assert_close(val["stage1"], val["ddp"], rtol=FP32, atol=0)


def test_trainer_resume_and_convert(trainer: tuple[dict[str, Any], Path]) -> None:
    """Stage 3 saved after epoch 1 and resumed with fit(ckpt_path=...) (its losses are checked above);
    the final checkpoint, saved with exclude_frozen_parameters=True, converted by Lightning's
    convert_zero_checkpoint_to_fp32_state_dict: DDP's final weights without the frozen projection, with
    Lightning's own keys beside them, and load_from_checkpoint reads it."""
    report, out = trainer
    assert report["resumed_global_step"] == STEPS
    converted = torch.load(out / "final.pt", weights_only=False)
    for key in ("state_dict", "epoch", "global_step", "hyper_parameters", "loops", "lr_schedulers"):
        assert key in converted, key
    assert converted["global_step"] == STEPS
    assert converted["hyper_parameters"] == {"lr": 1e-2}
    ddp = torch.load(out / "ddp_final.pt", weights_only=True)
    frozen = {"proj.weight", "proj.bias"}
    assert set(converted["state_dict"]) == set(ddp) - frozen
    for name, value in converted["state_dict"].items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, ddp[name], rtol=FP32, atol=1e-6, msg=name)
    assert report["restored_equals_converted"] is True


def test_trainer_stage3_model_summary(trainer: tuple[dict[str, Any], Path]) -> None:
    """Lightning's DeepSpeedSummary (ds_numel, partition_numel): totals, and each layer's parameters
    split between the two ranks' partitions."""
    ranks = trainer[0]["summary"]
    for seen in ranks:
        assert (seen["total"], seen["trainable"]) == (500, 470)
        assert "Params per Device" in seen["text"]
    layers = dict(zip(ranks[0]["layers"], (int(p) for p in ranks[0]["params"])))
    shards = [dict(zip(seen["layers"], (int(p) for p in seen["per_device"]))) for seen in ranks]
    assert layers["net"] == 470 and layers["proj"] == 30
    for name, numel in layers.items():
        assert sum(shard[name] for shard in shards) == numel, name
    assert all(0 < shard["net"] < 470 for shard in shards)  # partitioned, not whole on every rank


def test_trainer_bf16_stages(trainer: tuple[dict[str, Any], Path]) -> None:
    losses = trainer[0]["losses"]
    for stage in (1, 2, 3):
        got = losses[f"bf16_stage{stage}"]
        assert_losses(got, losses["ddp"], BF16)
        assert max_rel_delta(got, losses["ddp"]) > 1e-4  # computed in bf16, not fp32


def test_trainer_compiled_module_equals_ddp(trainer: tuple[dict[str, Any], Path]) -> None:
    """The network compiled in place in configure_model (`net.compile()`, inductor; Lightning's Trainer refuses
    a torch.compile'd LightningModule under DeepSpeedStrategy) at stages 1 and 3: the run equals the eager
    ones (which equal DDP above) within fp32's rounding: inductor's kernels round differently."""
    losses = trainer[0]["losses"]
    assert trainer[0]["net_compiled"] == {"1": True, "3": True}
    for stage in (1, 3):
        assert_losses(losses[f"compiled_stage{stage}"], losses["ddp"], FP32)


def test_fabric_stages_equal_ddp_and_load_resumes(fabric: dict[str, Any]) -> None:
    """Fabric's loop (optimizer.step() and optimizer.zero_grad() on what fabric.setup returned) at
    stages 1-3 against DDP clipping at DeepSpeed's default 1.0; fabric.load into a model seeded
    differently repeats the uninterrupted run's last 4 steps exactly."""
    losses, starts = fabric["losses"], fabric["starts"]
    for stage in (1, 2, 3):
        assert_losses(losses[f"stage{stage}"], losses["ddp"], FP32)
        assert starts[f"loaded{stage}"] == 4
        assert losses[f"loaded{stage}"] == [r[4:] for r in losses[f"stage{stage}"]]


def test_fabric_bf16_stages(fabric: dict[str, Any]) -> None:
    losses = fabric["losses"]
    for stage in (1, 2, 3):
        got = losses[f"bf16_stage{stage}"]
        assert_losses(got, losses["ddp"], BF16)
        assert max_rel_delta(got, losses["ddp"]) > 1e-4
