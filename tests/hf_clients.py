"""Running the engine under the real Hugging Face clients, as their users do: the `deepspeed`
compatibility distribution (compat/deepspeed) installed for real with pip (into a folder on
PYTHONPATH, so the developer's environment is untouched and a real DeepSpeed there is not replaced),
and scripts started as processes (one rank plainly, two under zrun).

transformers and accelerate come with the test extra; the distribution is built from the repository
once per test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat" / "deepspeed"
EXAMPLE = ROOT / "examples" / "hf_trainer.py"


def install_compat(target: Path) -> Path:
    """`pip install --target TARGET compat/deepspeed`: a real distribution named deepspeed, found by
    importlib.metadata the way transformers and Accelerate look for DeepSpeed."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(target),
        str(COMPAT),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        # No setuptools in this environment: let pip fetch the build backend from the index.
        cmd.remove("--no-build-isolation")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {COMPAT}:\n{done.stdout}\n{done.stderr}")
    return target


def client_env(compat_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(compat_dir), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",  # nothing is downloaded: models are built from configs or a local folder
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def run_script(
    script: Path, args: list[str], world: int, env: dict[str, str], cwd: Path, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """`python SCRIPT ARGS` for one rank, `zrun --nproc_per_node WORLD SCRIPT ARGS` for more; a failure
    raises with the end of the output."""
    if world == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "launcher.zrun",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(free_port()),
            str(script),
            *args,
        ]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
            f"\n--- stderr\n{done.stderr[-8000:]}"
        )
    return done


def write_config(path: Path, stage: int, *, optimizer: bool = False, **extra: Any) -> Path:
    """A DeepSpeed config as HF users write them: every value HF knows is "auto". Without
    `optimizer`, Trainer builds its own optimizer and schedule and hands them to initialize."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }
    if stage == 3:
        config["zero_optimization"].update(
            {"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
        )
    if optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            config.setdefault(section, {})[name] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


def train_losses(report: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in report["log_history"] if "loss" in h]


def grad_norms(report: dict[str, Any]) -> list[float]:
    return [h["grad_norm"] for h in report["log_history"] if "grad_norm" in h]


def eval_loss(report: dict[str, Any]) -> float:
    return [h["eval_loss"] for h in report["log_history"] if "eval_loss" in h][-1]
