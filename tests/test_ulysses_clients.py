"""Sequence parallelism through the real Hugging Face clients, turned on as their users do: Accelerate's
ParallelismConfig(sp_backend="deepspeed", sp_size=2) in an Accelerator of one's own loop, in TrainingArguments (the Trainer prepares the model
through Accelerate's DeepSpeed path: UlyssesSPAttentionHF.register_with_transformers, mpu= to initialize,
UlyssesSPDataLoaderAdapter on its loader, and transformers' deepspeed_sp_compute_loss), and TRL's
SFTTrainer with the same. tests/hf_scripts/ulysses_clients.py under zrun at 2 ranks; the reference is the
same client without sequence parallelism or DeepSpeed in one process (torch's AdamW, its clipping), on
the same samples in the same order.

The Trainer at ZeRO-2 and ZeRO-3, Accelerate's loop at ZeRO-3 and TRL's SFTTrainer at ZeRO-3 each equal
it to 1e-5 relative, losses and gradient norms (fp32; measured 2e-7). TRL computes the loss another way
under sequence parallelism (its fused LM head on the pre-shifted labels, reduced by transformers'
deepspeed_sp_compute_loss); SFTConfig's default bf16=True is turned off, as bf16 rounds a sequence of 16
tokens and two of 8 differently (2e-3 on the fourth step's norm, under real DeepSpeed too).

At 4 ranks (sp 2 x dp 2) the same clients equal one process training the same samples in the order the
two sequence-parallel groups take them. This needs engine/comm/torch_nn_gloo.py: torch's gloo backward of
the all_gather transformers' loss makes fails on a group that is not the whole world.

Each world size is one launch, its runs in turn (a launch costs every rank seconds of imports): the
references in one process, the 2-rank runs, the 4-rank runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_clients import ROOT, client_env, run_script, write_config

SCRIPT = ROOT / "tests" / "hf_scripts" / "ulysses_clients.py"
Report = dict[str, dict[str, list[float]]]


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


def run(env: dict[str, str], out: Path, world: int, runs: list[dict[str, str]], *args: str) -> Report:
    """Each run's losses and gradient norms, by run name; `runs` as the script's --runs takes them."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    run_script(SCRIPT, [*args, "--runs", json.dumps(runs), "--out", str(report)], world, env, out, timeout=420)
    return json.loads(report.read_text())


def accelerate_config(path: Path, stage: int) -> Path:
    """A config with values (no "auto": an Accelerate loop of one's own fills none)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    path.write_text(json.dumps(config))
    return path


CLIENTS = ("accelerate", "trainer", "sft")


@pytest.fixture(scope="module")
def plain(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Report:
    """The three clients without sequence parallelism or DeepSpeed, in one process: on the samples in turn
    (the 2-rank runs' reference), and at micro-batch 4 in the order the two sequence-parallel groups of 4
    ranks take them ("<client>_of_4": sp 2 x dp 2 sampling in order trains batches of micro x dp = 4)."""
    runs = [{"name": c, "client": c} for c in CLIENTS]
    runs += [{"name": f"{c}_of_4", "client": c, "micro": 4, "order_of": "4,2,2"} for c in CLIENTS]
    return run(env, tmp_path_factory.mktemp("plain"), 1, runs)


@pytest.fixture(scope="module")
def sp2(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Report:
    """At 2 ranks with sp 2: Accelerate's loop at ZeRO-3, the Trainer at ZeRO-2 and ZeRO-3, TRL's
    SFTTrainer at ZeRO-3."""
    out = tmp_path_factory.mktemp("sp2")
    zero2, zero3 = str(write_config(out / "ds2.json", 2)), str(write_config(out / "ds3.json", 3))
    runs = [
        {"name": "accelerate", "client": "accelerate", "deepspeed": str(accelerate_config(out / "acc3.json", 3))},
        {"name": "trainer_zero2", "client": "trainer", "deepspeed": zero2},
        {"name": "trainer_zero3", "client": "trainer", "deepspeed": zero3},
        {"name": "sft_zero3", "client": "sft", "deepspeed": zero3},
    ]
    return run(env, out, 2, runs, "--sp", "2")


def assert_equal_runs(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"]) == 4
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_sp2_equals_plain_trainer(plain: Report, sp2: Report, stage: int) -> None:
    """At ZeRO-3 TRL's SFTTrainer too (it trains after the Trainer in the same launch, as in the reference)."""
    assert_equal_runs(sp2[f"trainer_zero{stage}"], plain["trainer"])
    if stage == 3:
        assert_equal_runs(sp2["sft_zero3"], plain["sft"])


def test_accelerate_loop_with_sp2_equals_plain_loop(plain: Report, sp2: Report) -> None:
    """Accelerator(parallelism_config=...) in a loop of one's own, at ZeRO-3: prepare registers the attention,
    builds the engine with the groups and cuts the loader; the loss is engine.sequence.sequence_parallel_loss."""
    assert_equal_runs(sp2["accelerate"], plain["accelerate"])


# Sequence x data parallelism: 4 ranks, sp 2 x dp 2. The loaders sample in order; the reference trains the
# same samples, in the order the two sequence-parallel groups take them, in batches of micro x dp = 4.
@pytest.fixture(scope="module")
def sp2_dp2(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Report:
    """Accelerate's loop at ZeRO-2, then the Trainer and TRL's SFTTrainer at ZeRO-3, at 4 ranks."""
    out = tmp_path_factory.mktemp("sp2dp2")
    zero3 = str(write_config(out / "ds3.json", 3))
    runs = [
        {"name": "accelerate", "client": "accelerate", "deepspeed": str(accelerate_config(out / "acc2.json", 2))},
        {"name": "trainer", "client": "trainer", "deepspeed": zero3},
        {"name": "sft", "client": "sft", "deepspeed": zero3},
    ]
    return run(env, out, 4, runs, "--sp", "2", "--sequential")


def test_trainer_and_trl_at_sp2_dp2_equal_plain(plain: Report, sp2_dp2: Report) -> None:
    """The loss goes through transformers' deepspeed_sp_compute_loss: torch.distributed.nn's all_gather on
    each [0, 1] / [2, 3] group."""
    assert_equal_runs(sp2_dp2["trainer"], plain["trainer_of_4"])
    assert_equal_runs(sp2_dp2["sft"], plain["sft_of_4"])


def test_accelerate_loop_at_sp2_dp2_equals_plain(plain: Report, sp2_dp2: Report) -> None:
    assert_equal_runs(sp2_dp2["accelerate"], plain["accelerate_of_4"])
