"""Hugging Face Accelerate used directly on the engine, as its users drive DeepSpeed: tests/hf_scripts/
accelerate_loop.py builds `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict))`, prepares a
small MLP, a DataLoader and torch's AdamW (or DummyOptim/DummyScheduler standing for the config's AdamW
and WarmupLR), trains with accelerator.backward / optimizer.step(), calls save_state midway,
get_state_dict at the end, free_memory, then builds a second engine in the same process and resumes with
load_state. The engine is found through the `deepspeed` distribution built from compat/deepspeed; 1 rank
runs plainly, 2 under zrun.

The reference (computed by the script on rank 0 after the engine runs) is plain torch in one process:
the same initial model, each step on the whole global batch of 8 (Accelerate gives rank r batch r of
every `world` consecutive batches of 8 // world), torch's AdamW, clip_grad_norm_ at the same threshold,
and for the config optimizer DeepSpeed's WarmupLR written out by hand. fp32 throughout, so the engine
matches it to rounding (rtol 1e-5 over 6 Adam steps: the ranks' gradients are summed, and the norm
computed, in another order); a resume repeats the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_clients import ROOT, client_env, run_script

SCRIPT = ROOT / "tests" / "hf_scripts" / "accelerate_loop.py"
STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8
CLIP = 2.0  # the script's gradient_clipping
RTOL = 1e-5  # fp32, summation order only (measured: under 3e-7 relative on losses and norms, 1e-7 absolute on weights)


@dataclass
class Run:
    report: dict[str, Any]
    out: Path

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"{name}.pt", weights_only=True)


def loop(
    env: dict[str, str],
    out: Path,
    stage: int,
    world: int,
    config_optimizer: bool,
    *flags: str,
    state_dir: Path | None = None,
) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "--stage",
        str(stage),
        "--steps",
        str(STEPS),
        "--save_at",
        str(SAVE_AT),
        "--batch",
        str(GLOBAL_BATCH // world),
        "--state_dir",
        str(state_dir or out / "state"),
        "--report_dir",
        str(out),
        *flags,
    ]
    if config_optimizer:
        args.append("--config_optimizer")
    run_script(SCRIPT, args, world, env, out)
    return Run(json.loads((out / "report.json").read_text()), out)


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


@pytest.fixture(scope="module")
def runs(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, bool], Run]:
    """One script run per (stage, world, config optimizer), shared by the tests that read its report."""
    done: dict[tuple[int, int, bool], Run] = {}

    def get(stage: int, world: int, config_optimizer: bool) -> Run:
        key = (stage, world, config_optimizer)
        if key not in done:
            out = tmp_path_factory.mktemp(f"accelerate_s{stage}_w{world}_{'config' if config_optimizer else 'torch'}")
            done[key] = loop(env, out, stage, world, config_optimizer)
        return done[key]

    return get


SETUPS = [  # (stage, world, optimizer and schedule from the config)
    pytest.param(1, 1, False, id="stage1-1rank-torch_adamw"),
    pytest.param(2, 2, False, id="stage2-2ranks-torch_adamw"),
    pytest.param(3, 2, False, id="stage3-2ranks-torch_adamw"),
    pytest.param(3, 2, True, id="stage3-2ranks-config_adamw_warmuplr"),
]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=rtol, atol=rtol / 10, msg=name)


@pytest.mark.parametrize(("stage", "world", "config_optimizer"), SETUPS)
def test_accelerate_loop_equals_plain_torch(
    runs: Callable[[int, int, bool], Run], stage: int, world: int, config_optimizer: bool
) -> None:
    """Losses, pre-clipping grad norms and the full weights from accelerator.get_state_dict (stages 1-2:
    the module's state dict through deepspeed.checkpoint.utils.clone_tensors_for_torch_save; stage 3:
    engine._zero3_consolidated_16bit_state_dict, gathered to rank 0) equal plain torch's."""
    run = runs(stage, world, config_optimizer)
    report, first = run.report, run.report["first"]
    # Accelerate really took the DeepSpeed path with the whole world (not DDP, not one process each).
    assert report["deepspeed"] and report["num_processes"] == world
    assert first["is_engine"] and first["stage"] == stage
    assert first["config"]["train_batch_size"] == GLOBAL_BATCH
    assert first["partitioned"] == (first["params"] if stage == 3 else 0) and first["params"] == 6
    # The threshold splits the steps, so a clipping that is skipped or always applied shows.
    assert min(report["reference_grad_norms"]) < CLIP < max(report["reference_grad_norms"])

    assert len(report["losses"]) == STEPS
    torch.testing.assert_close(report["losses"], report["reference_losses"], rtol=RTOL, atol=0)
    torch.testing.assert_close(report["grad_norms"], report["reference_grad_norms"], rtol=RTOL, atol=0)
    assert_same_weights(run.weights("final"), run.weights("reference"), RTOL)


@pytest.mark.parametrize(("stage", "world", "config_optimizer"), SETUPS)
def test_free_memory_then_load_state_resumes_exactly(
    runs: Callable[[int, int, bool], Run], stage: int, world: int, config_optimizer: bool
) -> None:
    """free_memory destroys the engine; a second Accelerator in the same process builds a second engine
    from a differently seeded model, load_state restores weights, Adam state and schedule, and the
    remaining steps repeat the uninterrupted run's losses, grad norms and final weights bit for bit."""
    run = runs(stage, world, config_optimizer)
    report, second = run.report, run.report["second"]
    assert report["destroyed_by_free_memory"]
    assert second["is_engine"] and second["stage"] == stage
    assert second["partitioned"] == (second["params"] if stage == 3 else 0)
    assert report["resumed_losses"] == report["losses"][SAVE_AT:]
    assert report["resumed_grad_norms"] == report["grad_norms"][SAVE_AT:]
    assert_same_weights(run.weights("resumed_final"), run.weights("final"), rtol=0)


def test_stage3_load_state_in_a_fresh_process(
    env: dict[str, str], runs: Callable[[int, int, bool], Run], tmp_path: Path
) -> None:
    """The stage-3 save_state folder (config AdamW and WarmupLR) loaded by a new process's first
    Accelerator: steps 4-6 and the final gathered weights equal the uninterrupted run's exactly."""
    whole = runs(3, 2, True)
    resumed = loop(env, tmp_path, 3, 2, True, "--resume_only", state_dir=whole.out / "state")
    assert resumed.report["deepspeed"] and resumed.report["second"]["partitioned"] == 6
    assert resumed.report["resumed_losses"] == whole.report["losses"][SAVE_AT:]
    assert resumed.report["resumed_grad_norms"] == whole.report["grad_norms"][SAVE_AT:]
    assert_same_weights(resumed.weights("resumed_final"), whole.weights("final"), rtol=0)
