"""TRL's SFTTrainer, DPOTrainer, GRPOTrainer, RLOOTrainer and OnlineDPOTrainer on the engine at ZeRO stages 2
and 3, driven as TRL's users drive DeepSpeed: tests/trl_scripts/trl_train.py with the real trl, transformers
and accelerate, the engine found through the `deepspeed` distribution built from compat/deepspeed, 2 ranks
under zrun over gloo.

Two launches run every trainer in turn (SFT, DPO with a reference model and with precompute_ref_log_probs,
GRPO, RLOO and online DPO with TRL's defaults: at stage 3 ds3_gather_for_generation gathers every parameter
for the whole generation and removes and re-adds the engine's stage-3 hooks through
optimizer.parameter_offload; and at stage 3 GRPO with it off): plain DDP (no DeepSpeed) in one, stage 2 then
stage 3 in the other (a launch costs each rank seconds of imports), from one tiny Llama (tied embeddings, a
character tokenizer, both built in code and saved first; TRL loads the model by its folder, at stage 3 under zero.Init). Same global
batch (4 per rank), same seed, fp32: the ranks' gradients are averaged in another order than DDP's, so the
losses agree to fp32 rounding (measured: SFT bit-equal, DPO within 6e-7); 1e-5 is the bound.

DPO's reference model is what TRL's prepare_deepspeed makes it: a second engine built by
deepspeed.initialize for inference (stage 0 beside a stage-2 policy, partitioned beside a stage-3 one),
refreshed every 2 steps by TRL's SyncRefModelCallback (at stage 3 inside GatheredParameters of both engines
with modifier_rank=0), so losses at steps 3-4 check that write too.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hf_clients import ROOT, client_env, run_script, write_config

SCRIPT = ROOT / "tests" / "trl_scripts" / "trl_train.py"
WORLD = 2
LOSS_ATOL = 1e-5
TRAINERS = "sft,dpo,dpo_precompute,grpo,rloo,online_dpo"
ONLINE = {"grpo": "reward", "rloo": "reward", "online_dpo": "objective/scores"}
"""Trained with TRL's defaults: ds3_gather_for_generation=True (at stages 0-2 TRL gathers nothing either way);
each with the key under which it logs the mean reward of its completions."""


class Launch:
    """One configuration's run: rank 0's report and its launch's stderr (the engine's warnings)."""

    def __init__(self, report: dict[str, Any], done: subprocess.CompletedProcess[str]) -> None:
        self.report = report
        self.stderr = done.stderr


def launch(
    env: dict[str, str], model: Path, out: Path, runs: list[tuple[Path | None, str]], save_model: bool = False
) -> list[Launch]:
    """One launch training each (config, trainers) of `runs` in turn (no config: plain DDP); a Launch each."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["--model", str(model), "--out", str(out)]
    if save_model:  # rank 0 writes the model first (every later launch loads it)
        args += ["--save_init", str(model)]
    for config, trainers in runs:
        args += ["--trainers", trainers] + (["--deepspeed", str(config)] if config is not None else [])
    done = run_script(SCRIPT, args, WORLD, env, out, timeout=480)
    folders = [out] if len(runs) == 1 else [out / Path(str(config)).stem for config, _ in runs]
    return [Launch(json.loads((folder / "report.json").read_text()), done) for folder in folders]


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny Llama and its tokenizer every run loads are saved (save_pretrained), by the plain launch."""
    return tmp_path_factory.mktemp("trl_model") / "tiny-llama"


@pytest.fixture(scope="module")
def plain(env: dict[str, str], model: Path, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Plain DDP; its first rank writes the model first (one launch fewer)."""
    return launch(env, model, tmp_path_factory.mktemp("trl_plain"), [(None, TRAINERS)], save_model=True)[0]


@pytest.fixture(scope="module")
def zero(
    env: dict[str, str], model: Path, plain: Launch, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Launch]:
    """Stage 2, then stage 3, in one launch (after the plain one, which writes the model it loads). HF-style
    configs ("auto" everywhere, Trainer's own AdamW and schedule). At stage 3, also GRPO with
    ds3_gather_for_generation=False (each layer gathered as generation runs)."""
    del plain
    tmp = tmp_path_factory.mktemp("trl_zero")
    runs = [
        (write_config(tmp / "zero2.json", 2), TRAINERS),
        (write_config(tmp / "zero3.json", 3), TRAINERS + ",grpo_nogather"),
    ]
    return dict(zip((2, 3), launch(env, model, tmp / "out", runs), strict=True))


@pytest.fixture(scope="module")
def stage3(zero: dict[int, Launch]) -> Launch:
    return zero[3]


def losses(run: dict[str, Any], key: str = "loss") -> list[float]:
    return [h[key] for h in run["log_history"] if key in h and "train_runtime" not in h]


def assert_same_training(got: dict[str, Any], want: dict[str, Any], steps: int, name: str) -> None:
    assert len(losses(got)) == len(losses(want)) == steps, name
    delta = max(abs(a - b) for a, b in zip(losses(got), losses(want)))
    assert delta <= LOSS_ATOL, f"{name}: losses {losses(got)} vs plain DDP {losses(want)} (max delta {delta:.2e})"
    for a, b in zip(losses(got, "grad_norm"), losses(want, "grad_norm")):
        assert abs(a - b) <= 1e-4 * b, f"{name}: grad norms {losses(got, 'grad_norm')} vs {losses(want, 'grad_norm')}"


def check_stage(run: Launch, plain: Launch, stage: int) -> None:
    sft, dpo = run.report["sft"], run.report["dpo"]
    assert_same_training(sft, plain.report["sft"], 4, f"SFT stage {stage}")
    assert_same_training(dpo, plain.report["dpo"], 4, f"DPO stage {stage}")
    if stage < 3:  # at stage 3 refused by name (test below)
        assert_same_training(
            run.report["dpo_precompute"],
            plain.report["dpo_precompute"],
            4,
            f"DPO precompute_ref_log_probs stage {stage}",
        )
    # GRPO, RLOO, online DPO: the same completions sampled (same rewards), the same gradients.
    online = [(name, name) for name in ONLINE] + ([("grpo_nogather", "grpo")] if stage == 3 else [])
    for name, want in online:
        got, reward = run.report[name], ONLINE[want]
        assert got["model"]["class"] == "Engine" and got["model"]["stage"] == stage, name
        assert_same_training(got, plain.report[want], 2, f"{name} stage {stage}")
        assert len(losses(got, reward)) == 2 and losses(got, reward) == losses(plain.report[want], reward), name

    assert sft["model"]["class"] == dpo["model"]["class"] == "Engine"
    assert sft["model"]["stage"] == dpo["model"]["stage"] == stage
    ref = dpo["ref_model"]  # prepare_deepspeed: stage 0 below ZeRO-3, partitioned at ZeRO-3
    assert (ref["class"], ref["stage"]) == ("Engine", 0 if stage < 3 else 3)
    for wrapped in (sft["model"], dpo["model"], ref):
        whole = wrapped["local_numel"] == wrapped["numel"]
        assert whole == (stage < 3), wrapped  # at stage 3 rank 0 holds its slice (loaded under zero.Init)
    # TRL's fused LM head reads lm_head.weight.ds_status at stage 3 (trl/trainer/utils.py maybe_gather_lm_head_ctx)
    # and gathers the weight when it is not AVAILABLE (the engine's root unit, holding the head, is gathered
    # through the model's forward, so today it reads AVAILABLE).
    for statuses in (sft["lm_head_statuses"], dpo["lm_head_statuses"]):
        assert (set(statuses) <= {"AVAILABLE", "NOT_AVAILABLE"} and statuses) if stage == 3 else not statuses


def test_sft_dpo_grpo_at_zero_stage_2_equal_plain_ddp(plain: Launch, zero: dict[int, Launch]) -> None:
    assert plain.report["sft"]["model"]["class"] == "DistributedDataParallel"  # really 2 ranks, not 2 copies
    check_stage(zero[2], plain, 2)


def test_sft_dpo_grpo_at_zero_stage_3_equal_plain_ddp(plain: Launch, stage3: Launch) -> None:
    check_stage(stage3, plain, 3)


def test_trl_dotted_zero_keys_are_warned_by_name(stage3: Launch) -> None:
    """prepare_deepspeed (trl/models/utils.py) adds top-level dotted keys for the stage-3 reference model;
    DeepSpeed never reads them (it reads nested sections), and the engine says so, naming each."""
    for key in ("reduce_bucket_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        assert (
            f"zero_optimization.{key}: a dotted top-level key is ignored, as DeepSpeed ignores it" in stage3.stderr
            and f'write it nested: {{"zero_optimization": {{"{key}": ' in stage3.stderr
        ), key


def test_dpo_precompute_ref_log_probs_at_zero3_is_refused_by_name(stage3: Launch) -> None:
    """DPOTrainer(precompute_ref_log_probs=True) wraps the policy in an inference engine for its log-prob pass
    and keeps it; at stage 3 that engine holds the parameters when training wraps the policy again (DeepSpeed
    shares one partition between engines; this engine does not): refused at the training engine's initialize,
    naming TRL's setting (a raw "'weight' must be 2-D" from torch at the first forward before)."""
    refused = stage3.report["dpo_precompute"]["refused"]
    assert "partitioned by another ZeRO stage 3 engine that is still alive" in refused
    assert "set precompute_ref_log_probs=False" in refused
