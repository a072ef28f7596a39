"""The Trainer with `TrainingArguments(torch_compile=True)` at ZeRO stages 0-3 on 2 ranks, as its users turn
it on (Accelerate calls engine.compile(backend=...), here with torch_compile_backend="aot_eager"), and at
stage 3 also Accelerate's regional compilation (each decoder layer's compile()), against the same Trainer
eager: a tiny Llama from its config, 4 steps, fp32, one launch (tests/hf_scripts/trainer_compile.py).

Losses and gradient norms equal the eager run's to 1e-5 relative (with inductor, the Trainer's default, measured
1e-7 while this test was written: its kernels round differently from eager ones). Dynamo compiles during the first step and never after. The consolidated state
dict has the model's own names (no `_orig_mod.`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_clients import ROOT, client_env, run_script, write_config

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def report(deepspeed_compat: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("compile")
    configs = [str(write_config(tmp / f"zero{stage}.json", stage)) for stage in STAGES]
    # "aot_eager" (torch_compile_backend): the same path through Accelerate and the engine as the Trainer's
    # default inductor, without inductor's C++ build of each kernel (40 s for this model's graph on 2 cores;
    # tests/test_compile.py trains with inductor at every stage).
    specs = [config + ":aot_eager" for config in configs]
    out = tmp / "report.json"
    script = ROOT / "tests" / "hf_scripts" / "trainer_compile.py"
    args = [*specs, "--regional", specs[-1], "--out", str(out)]
    run_script(script, args, 2, client_env(deepspeed_compat), tmp, timeout=600)
    return json.loads(out.read_text())


def _assert_equal_to_eager(run: dict, eager: dict) -> None:
    assert len(run["losses"]) == len(eager["losses"]) == 4
    torch.testing.assert_close(run["losses"], eager["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(run["norms"], eager["norms"], rtol=1e-5, atol=0)
    assert run["graphs_at_end"] == run["graphs_after_step_1"], "Dynamo compiled again after the first step"
    assert run["keys"] == eager["keys"] and not any("_orig_mod" in k for k in run["keys"])


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_torch_compile_equals_eager(report: dict, stage: int) -> None:
    runs = report[f"zero{stage}"]
    assert runs["compiled"]["is_compiled"] and not runs["eager"]["is_compiled"]
    assert runs["eager"]["graphs_at_end"] == 0
    _assert_equal_to_eager(runs["compiled"], runs["eager"])


def test_accelerate_regional_compilation_at_stage_3_equals_eager(report: dict) -> None:
    runs = report["zero3"]
    regional = runs["regional"]
    assert not regional["is_compiled"] and regional["layers_compiled"] == 2  # every decoder layer, not the engine
    _assert_equal_to_eager(regional, runs["eager"])
