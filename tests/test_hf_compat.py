"""The `deepspeed` compatibility distribution (compat/deepspeed) and what the engine gives it: the
installed distribution is what transformers and Accelerate look for, every alias is the engine's own
object, DeepSpeed's optimizer classes compute what their names say, and what the engine does not
implement (tensor parallelism and NVMe offload through the Trainer) stops a Trainer run at
initialize with an error naming the setting, never an AttributeError from inside the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_clients import ROOT, client_env, run_script, write_config

import engine
from engine.runtime.engine import NoOptimizerError
from engine.optim import Lion
from engine.optim.deepspeed_classes import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam

ALIASES = """
import importlib, importlib.metadata, json
import deepspeed, engine, engine.runtime.engine, engine.zero, engine.zero.partitioned_init, engine.comm, engine.accelerator
import engine.zero.clone, engine.optim.deepspeed_classes as classes
from transformers.integrations import is_deepspeed_available
from accelerate.utils import compare_versions, is_deepspeed_available as accelerate_sees
checks = {
    "version": importlib.metadata.version("deepspeed"),
    "__version__": deepspeed.__version__,
    "transformers_sees": is_deepspeed_available(),
    "accelerate_sees": accelerate_sees() and compare_versions("deepspeed", ">=", "0.16.4"),
    "initialize": deepspeed.initialize is engine.initialize,
    "engine": deepspeed.DeepSpeedEngine is engine.runtime.engine.Engine
        and importlib.import_module("deepspeed.runtime.engine").DeepSpeedEngine is engine.runtime.engine.Engine,
    "comm": all(getattr(deepspeed.comm, n) is getattr(engine.comm, n)
                for n in ("init_distributed", "is_initialized", "get_rank", "get_world_size", "barrier")),
    "zero": deepspeed.zero.Init is engine.zero.Init and deepspeed.zero.GatheredParameters is engine.zero.GatheredParameters,
    "partition_parameters": importlib.import_module("deepspeed.runtime.zero.partition_parameters") is engine.zero.partitioned_init,
    "utils": all(getattr(deepspeed.utils, n) is getattr(engine.zero, n)
                 for n in ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
                           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
                           "set_z3_leaf_modules_by_suffix"))
        and deepspeed.utils.logger.name == "engine",
    "zero_to_fp32": all(getattr(importlib.import_module("deepspeed.utils.zero_to_fp32"), n)
                        is getattr(importlib.import_module("engine.checkpoint.zero_to_fp32"), n)
                        for n in ("get_optim_files", "get_model_state_files", "get_model_state_file",
                                  "get_checkpoint_files", "get_fp32_state_dict_from_zero_checkpoint")),
    "ops": importlib.import_module("deepspeed.ops.adam").DeepSpeedCPUAdam is classes.DeepSpeedCPUAdam
        and importlib.import_module("deepspeed.ops.adam").FusedAdam is classes.FusedAdam
        and importlib.import_module("deepspeed.ops.adagrad").DeepSpeedCPUAdagrad is classes.DeepSpeedCPUAdagrad
        and importlib.import_module("deepspeed.ops.lion").DeepSpeedCPULion is classes.DeepSpeedCPULion,
    "lr_schedules": deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,
    "clone": importlib.import_module("deepspeed.checkpoint.utils").clone_tensors_for_torch_save
        is engine.zero.clone.clone_tensors_for_torch_save,
    "checkpointing": deepspeed.checkpointing is engine.checkpointing
        and importlib.import_module("deepspeed.runtime.activation_checkpointing.checkpointing") is engine.checkpointing,
    "accelerator": importlib.import_module("deepspeed.accelerator").get_accelerator is engine.accelerator.get_accelerator
        and deepspeed.accelerator.get_accelerator().current_device_name() == "cpu",
}
print(json.dumps(checks))
"""


@pytest.fixture(scope="module")
def env(deepspeed_compat: Path) -> dict[str, str]:
    return client_env(deepspeed_compat)


def test_installed_distribution_is_found_and_every_alias_is_the_engines(env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ALIASES], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert checks.pop("version") == checks.pop("__version__") == "0.19.8+zeroengine"
    assert checks.pop("lr_schedules") == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert checks == {name: True for name in checks}, [name for name, ok in checks.items() if not ok]


# -------------------------------------------------------------- Trainer options the engine refuses
@pytest.fixture(scope="module")
def refused(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Each refused Trainer use tried at 2 ranks, in turn in one launch (tests/hf_scripts/trainer_refusals.py):
    what `trainer.train()` raised, as `TypeName: message`, by case (None: nothing)."""
    tmp = tmp_path_factory.mktemp("refused")
    nvme = json.loads(write_config(tmp / "ds3.json", 3).read_text())
    nvme["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp)}
    (tmp / "nvme.json").write_text(json.dumps(nvme))
    cases = {
        "tensor_parallel": {"deepspeed": str(write_config(tmp / "tp.json", 2, tensor_parallel={"autotp_size": 2}))},
        "nvme": {"deepspeed": str(tmp / "nvme.json")},
        "evaluate_then_train": {"deepspeed": str(ROOT / "configs" / "hf" / "zero3.json"), "evaluate_first": True},
    }
    (tmp / "cases.json").write_text(json.dumps(cases))
    report = tmp / "refused.json"
    run_script(
        ROOT / "tests" / "hf_scripts" / "trainer_refusals.py",
        [str(tmp / "cases.json"), "--out", str(report)],
        2,
        env,
        tmp,
    )
    results = json.loads(report.read_text())
    assert results["evaluate_then_train"]["evaluated"]  # evaluate() went through; train() is what stopped
    return {name: r["raised"] for name, r in results.items()}


def test_trainer_tensor_parallel_is_refused_naming_the_key(refused: dict[str, str | None]) -> None:
    error = refused["tensor_parallel"]
    assert error and error.startswith(
        "UnsupportedFeatureError: tensor_parallel.autotp_size = 2 through Hugging Face Trainer"
    ), error
    assert "remove tensor_parallel from the DeepSpeed config" in error


def test_trainer_nvme_offload_is_refused_naming_the_key(refused: dict[str, str | None]) -> None:
    error = refused["nvme"]
    assert error and error.startswith("ConfigError"), error
    assert "zero_optimization.offload_param.device" in error and "nvme" in error


def test_trainer_evaluate_then_train_at_stage3_names_the_destroyed_engine(refused: dict[str, str | None]) -> None:
    """transformers 5.24 trains with the evaluation-only engine that its own train() just destroyed
    (DeepSpeed: AttributeError 'NoneType' object has no attribute 'backward'): the engine's error says
    what happened and what to do."""
    error = refused["evaluate_then_train"]
    assert error and error.startswith("DestroyedEngineError: this engine was destroyed"), error
    assert "train first, or evaluate with a separate Trainer" in error


# ----------------------------------------------------------------- DeepSpeed's optimizer classes
def _steps(make: type[torch.optim.Optimizer] | object, steps: int = 3, **kwargs: object) -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64))
    opt = make([weight], **kwargs)  # type: ignore[operator]
    for step in range(steps):
        weight.grad = torch.sin(torch.arange(64.0) * (step + 1))
        opt.step()
    return weight.detach().clone()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_cpu_adam_is_adam_or_adamw(adamw_mode: bool) -> None:
    want = _steps(torch.optim.AdamW if adamw_mode else torch.optim.Adam, lr=1e-2, weight_decay=0.1)
    got = _steps(DeepSpeedCPUAdam, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_fused_adam_is_adamw_by_default_and_refuses_what_it_cannot_compute() -> None:
    torch.testing.assert_close(
        _steps(FusedAdam, lr=1e-2, weight_decay=0.1),
        _steps(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        rtol=1e-6,
        atol=1e-7,
    )
    torch.testing.assert_close(
        _steps(FusedAdam, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
        _steps(torch.optim.Adam, lr=1e-2, weight_decay=0.1),
        rtol=1e-6,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match='"bias_correction": false'):
        FusedAdam([torch.nn.Parameter(torch.ones(1))], bias_correction=False)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.ones(1))], amsgrad=True)


def test_adagrad_and_lion_take_deepspeeds_arguments() -> None:
    torch.testing.assert_close(
        _steps(DeepSpeedCPUAdagrad, lr=1e-2, eps=1e-10, weight_decay=0.1, fp32_optimizer_states=False),
        _steps(torch.optim.Adagrad, lr=1e-2, eps=1e-10, weight_decay=0.1),
    )
    torch.testing.assert_close(
        _steps(DeepSpeedCPULion, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
        _steps(Lion, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    )
    # DeepSpeedCPUAdam's positional order is DeepSpeed's: (params, lr, bias_correction, betas, eps, ...)
    positional = _steps(lambda params: DeepSpeedCPUAdam(params, 1e-2, True, (0.8, 0.9), 1e-6))
    torch.testing.assert_close(
        positional,
        _steps(torch.optim.AdamW, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0),
        rtol=1e-6,
        atol=1e-7,
    )


# ------------------------------------------------------------------------ engine behaviour HF relies on
def test_scheduler_section_without_optimizer_is_not_built() -> None:
    """HF's ZeRO inference deletes "optimizer" from the training config and keeps "scheduler"; DeepSpeed
    builds a schedule only with an optimizer, and so does the engine (it used to refuse the config)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    }
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    eng, optimizer, _, scheduler = engine.initialize(model=model, config=config)
    try:
        assert optimizer is None and scheduler is None
        with torch.no_grad():
            assert eng(torch.ones(2, 4)).shape == (2, 1)
        with pytest.raises(NoOptimizerError):
            eng.backward(eng(torch.ones(2, 4)).sum())
    finally:
        eng.destroy()


def test_an_applications_process_group_is_destroyed_at_exit(tmp_path: Path) -> None:
    """Left to interpreter shutdown, gloo could abort a rank whose work was done (engine/comm/lifecycle.py,
    _teardown_at_exit); the engine destroys the default group at exit, even one the application made.
    The check runs after the engine's handler (atexit runs handlers in reverse order of registration)."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "import engine\n"
        "eng, *_ = engine.initialize(model=torch.nn.Linear(2, 2), config={'train_micro_batch_size_per_gpu': 1})\n"
        "print('initialized before exit:', dist.is_initialized())\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "initialized before exit: True" in done.stdout
    assert "initialized at exit: False" in done.stdout
