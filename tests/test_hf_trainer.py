"""Hugging Face Trainer trains on the engine, driven exactly as its users drive DeepSpeed:
`examples/hf_trainer.py --deepspeed CONFIG` with the real transformers and accelerate, the engine
found through the `deepspeed` distribution built from compat/deepspeed, 1 rank plainly and 2 under zrun.

Every run starts from one tiny GPT-2 saved locally first (from_pretrained: at stage 3 transformers
loads it partitioned under deepspeed.zero.Init). The reference is the same script without
--deepspeed: plain Trainer (torch's AdamW, its own clipping and schedule) in one process over the same
global batch (16 windows: 16 per device at 1 rank, 8 at 2,
4 x 2 accumulation steps), same seed. Accelerate gives rank r batch r of every group of N consecutive
batches of one seeded sampler, so the 2-rank global batch holds the same windows as the 1-rank batch
of 16, and the mean of the two ranks' mean losses is the batch mean (every window has as many
tokens). fp32 runs match it to rounding (rtol 1e-4 over 8 Adam steps: the ranks' gradients are summed
in another order); bf16 within bf16's precision (rtol 2e-2: the engine computes in bf16 with fp32
masters, plain Trainer keeps fp32 weights and autocasts).

The runs at one world size share a launch (tests/hf_scripts/example_runs.py calls the example's main() once
per run, in turn: a launch costs every rank seconds of imports): the initial model, the reference and stage 3
at 1 rank; stages 0-3, bf16 and ZeRO inference at 2. The resume test starts a fresh launch to resume in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_clients import ROOT, client_env, eval_loss, grad_norms, run_script, train_losses, write_config

RUNS = ROOT / "tests" / "hf_scripts" / "example_runs.py"
STEPS = 8
COMMON = [
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
    "--seed",
    "7",
    "--learning_rate",
    "2e-3",
    "--warmup_steps",
    "2",
    "--weight_decay",
    "0.01",
    "--n_layer",
    "2",
    "--n_embd",
    "64",
    "--seq_len",
    "32",
]


@dataclass
class Run:
    report: dict[str, Any]
    out: Path

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.out / "model.safetensors"))


def batch(world: int, accumulation: int = 1) -> list[str]:
    return [
        "--per_device_train_batch_size",
        str(16 // world // accumulation),
        "--gradient_accumulation_steps",
        str(accumulation),
    ]


def trainer(env: dict[str, str], out: Path, world: int, *args: str, common: list[str] = COMMON) -> Run:
    """Run the example into `out`; its report (log history, how the model was built)."""
    return runs(env, out.parent, world, {out.name: list(args)}, common=common)[out.name]


def runs(
    env: dict[str, str], where: Path, world: int, spec: dict[str, list[str]], common: list[str] = COMMON
) -> dict[str, Run]:
    """The example run once per entry of `spec` (name -> its flags), in turn in one launch, each into
    where/name; their reports by name."""
    argv = []
    for name, args in spec.items():
        out = where / name
        out.mkdir(parents=True, exist_ok=True)
        argv.append([*common, "--output_dir", str(out), "--report_file", str(out / "report.json"), *args])
    listing = where / f"runs-{'-'.join(spec)}.json"
    listing.write_text(json.dumps(argv))
    run_script(RUNS, [str(listing)], world, env, where, timeout=480)
    # --save_init_to saves the model and returns: no report
    saved = {
        name: {} if "--save_init_to" in args else json.loads((where / name / "report.json").read_text())
        for name, args in spec.items()
    }
    return {name: Run(report, where / name) for name, report in saved.items()}


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


@pytest.fixture(scope="module")
def one_rank(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """One launch at 1 rank: the model every run starts from, saved with save_pretrained ("initial": at
    stage 3 transformers loads it partitioned); the reference, plain Trainer (no DeepSpeed) at batch 16,
    its final model saved, which also evaluates the initial model before training (eval_on_start:
    evaluation draws no random numbers, so training is unchanged), the reference of ZeRO inference below;
    and stage 3 at 1 rank."""
    where = tmp_path_factory.mktemp("hf_one_rank")
    initial = where / "initial" / "tiny-gpt2"
    config = write_config(where / "ds3.json", 3)
    spec = {
        "initial": ["--save_init_to", str(initial)],
        "reference": [*batch(1), "--init_from", str(initial), "--eval_on_start", "true"],
        "stage3": [*batch(1), "--init_from", str(initial), "--deepspeed", str(config)],
    }
    return runs(env, where, 1, spec)


@pytest.fixture(scope="module")
def initial(one_rank: dict[str, Run]) -> Path:
    return one_rank["initial"].out / "tiny-gpt2"


@pytest.fixture(scope="module")
def reference(one_rank: dict[str, Run]) -> Run:
    return one_rank["reference"]


@pytest.fixture(scope="module")
def two_ranks(env: dict[str, str], initial: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """One launch at 2 ranks, the runs below in turn (each test says what its run is)."""
    where = tmp_path_factory.mktemp("hf_two_ranks")
    start = ["--init_from", str(initial)]
    spec = {
        f"stage{stage}": [*batch(2), *start, "--deepspeed", str(write_config(where / f"ds{stage}.json", stage))]
        for stage in (0, 2, 3)
    }
    config = write_config(where / "ds1_optimizer.json", 1, optimizer=True)
    without_scheduler = json.loads(config.read_text())
    del without_scheduler["scheduler"]
    config.write_text(json.dumps(without_scheduler))
    spec["accumulation"] = [*batch(2, accumulation=2), *start, "--deepspeed", str(config)]
    spec["bf16"] = [*batch(2), "--bf16", "true", *start, "--deepspeed", str(where / "ds2.json")]
    zero3 = str(ROOT / "configs" / "hf" / "zero3.json")
    spec["zero_inference"] = [*batch(2), *start, "--evaluate_only", "true", "--deepspeed", zero3]
    return runs(env, where, 2, spec)


def assert_matches(got: Run, want: Run, rtol: float) -> None:
    assert len(train_losses(got.report)) == STEPS
    torch.testing.assert_close(train_losses(got.report), train_losses(want.report), rtol=rtol, atol=0)
    torch.testing.assert_close(grad_norms(got.report), grad_norms(want.report), rtol=rtol * 10, atol=0)
    torch.testing.assert_close(eval_loss(got.report), eval_loss(want.report), rtol=rtol, atol=0)


@pytest.mark.parametrize("stage, world", [(0, 2), (2, 2), (3, 2), (3, 1)])
def test_trainer_at_each_stage_equals_plain_trainer(
    one_rank: dict[str, Run], two_ranks: dict[str, Run], reference: Run, stage: int, world: int
) -> None:
    """Trainer's own optimizer and schedule handed to initialize, at stages 0, 2 and 3 on 2 ranks, and at
    stage 3 (built partitioned under zero.Init) on 1; the model saved at the end (at stage 3 without
    stage3_gather_16bit_weights_on_model_save, Trainer falls back to save_checkpoint in the output
    folder). Stage 1 at 2 ranks is the accumulation test's below. One rank at stages 0-2 partitions
    nothing: the 2-rank runs cover them (and keep the suite inside its time)."""
    got = (one_rank if world == 1 else two_ranks)[f"stage{stage}"]
    assert_matches(got, reference, rtol=1e-4)
    if stage == 3:  # transformers loaded it under deepspeed.zero.Init: partitioned from the start
        assert got.report["partitioned_at_build"] == got.report["params"] > 0
        assert (got.out / "latest").read_text().strip() == f"global_step{STEPS}"
        assert not (got.out / "model.safetensors").exists()
    else:
        assert got.report["partitioned_at_build"] == 0
        saved, want = got.weights(), reference.weights()
        assert saved.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(saved[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_trainer_gradient_accumulation_with_config_optimizer(two_ranks: dict[str, Run], reference: Run) -> None:
    """An optimizer section in the config ("auto" params: the engine builds AdamW) with Trainer's own
    schedule (no scheduler section: HF hands initialize a callable), 2 accumulation steps of 4 per rank,
    at stage 1."""
    assert_matches(two_ranks["accumulation"], reference, rtol=1e-4)


def test_trainer_bf16(two_ranks: dict[str, Run], reference: Run) -> None:
    """--bf16 true at stage 2."""
    got = two_ranks["bf16"]
    assert got.report["log_history"][0]["loss"] != train_losses(reference.report)[0]  # bf16 really computed
    assert_matches(got, reference, rtol=2e-2)


def test_trainer_resume_gives_the_uninterrupted_losses(env: dict[str, str], tmp_path: Path) -> None:
    """configs/hf/zero3.json (optimizer and WarmupLR schedule from the config, 16-bit weights gathered
    at save) at 2 ranks with a model built by from_config (under zero.Init, partitioned as built),
    saving every 4 steps; resumed from checkpoint-4, steps 5-8 repeat the uninterrupted run's losses
    and grad norms exactly. The gathered model.safetensors equals the engine's own consolidation of
    the last checkpoint."""
    config = str(ROOT / "configs" / "hf" / "zero3.json")
    common = [c if c != "no" else "steps" for c in COMMON]  # --save_strategy steps
    whole = trainer(env, tmp_path / "whole", 2, *batch(2), "--deepspeed", config, "--save_steps", "4", common=common)
    resumed = trainer(
        env,
        tmp_path / "resumed",
        2,
        *batch(2),
        "--deepspeed",
        config,
        "--resume_from_checkpoint",
        str(whole.out / "checkpoint-4"),
    )
    assert whole.report["partitioned_at_build"] == whole.report["params"] > 0
    history = [h for h in resumed.report["log_history"] if "loss" in h and h["step"] > 4]
    assert [h["step"] for h in history] == [5, 6, 7, 8]
    assert train_losses({"log_history": history}) == train_losses(whole.report)[4:]
    assert grad_norms({"log_history": history}) == grad_norms(whole.report)[4:]

    consolidated = tmp_path / "consolidated.pt"
    subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(whole.out / "checkpoint-8"), str(consolidated)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    want = torch.load(consolidated, weights_only=True)
    saved = whole.weights()
    assert set(saved) <= set(want) and saved  # safetensors drops the tied lm_head.weight alias
    for name, tensor in saved.items():
        assert tensor.shape == want[name].shape and torch.equal(tensor, want[name].to(tensor.dtype)), name


def test_stage3_zero_inference_before_training(two_ranks: dict[str, Run], reference: Run) -> None:
    """trainer.evaluate() at stage 3 (configs/hf/zero3.json) with no training (ZeRO inference: initialize
    without an optimizer, the config's scheduler section left unbuilt), parameters loaded partitioned: the
    loss equals plain Trainer's evaluation of the same model before training (the reference's eval_on_start)."""
    zero = two_ranks["zero_inference"]
    assert zero.report["partitioned_at_build"] == zero.report["params"] > 0
    before_training = next(h["eval_loss"] for h in reference.report["log_history"] if "eval_loss" in h)
    assert before_training != eval_loss(reference.report)  # the reference evaluated before training too
    torch.testing.assert_close(eval_loss(zero.report), before_training, rtol=1e-5, atol=0)
