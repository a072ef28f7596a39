"""What a DeepSpeed checkpoint becomes for the engine's load (Converted: named pieces per rank, the
optimizer's scalar state, the head), and the helpers every layout's conversion builds it with
(layout.py: stages 1-3; stage0.py: stage 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.checkpoint.deepspeed_format.safe_load import DeepSpeedObject

Pieces = dict[str, list[dict[str, Any]]]
"""Parameter name -> its pieces in one rank's file: {"offset", "master" | "model", "exp_avg", ...}."""

# The keys of DeepSpeed's own in a model-states file; the others are the client_state it was given.
DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "iteration",
        "universal_checkpoint_info",
    }
)
# torch's switches for how an optimizer step runs in DeepSpeed's process: no part of the training state.
_RUN_SWITCHES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


@dataclass
class Converted:
    """A DeepSpeed checkpoint as the engine's pieces: what engine/checkpoint/store.py's load reads."""

    world_size: int
    stage: int
    params: dict[str, list[int]]
    """Every parameter's whole shape, trainable and frozen."""
    trainable: set[str]
    optim: list[Pieces]
    """Per rank: fp32 master pieces with their moments."""
    frozen: list[Pieces]
    """Per rank: stage-3 pieces of frozen parameters ({"offset", "model"})."""
    scalars: dict[int, dict[str, Any]]
    """Per optimizer group: the state not shaped like a master (Adam's step)."""
    whole: dict[str, torch.Tensor]
    """Buffers, and frozen parameters at stages 0-2."""
    head: dict[str, Any]
    """Counters, LR scheduler, loss scaler, param_groups, client_state: rank 0's model file's head."""
    aliases: dict[str, str] = field(default_factory=dict)


def moments_of(state: dict[str, Any], numel: int) -> dict[str, torch.Tensor]:
    """The optimizer state tensors laid like the flat partition (exp_avg, exp_avg_sq, ...). They may be
    longer than the saved partition: DeepSpeed drops the last rank's end padding from the fp32
    partition it saves, not from the moments."""
    return {k: v.reshape(-1) for k, v in state.items() if _like_partition(v, numel)}


def scalar_state(state: dict[str, Any], numel: int) -> dict[str, Any]:
    """The state not shaped like the partition. Adam's step becomes torch's layout (a float32 scalar
    tensor, as torch.optim.Optimizer.load_state_dict makes it): DeepSpeed's FusedAdam saves a Python int,
    which torch's AdamW step refuses ("state_steps ... singleton tensors")."""
    found = {k: v for k, v in state.items() if not _like_partition(v, numel)}
    if isinstance(found.get("step"), (int, float)) and not isinstance(found["step"], bool):
        found["step"] = torch.tensor(float(found["step"]), dtype=torch.float32)
    return found


def _like_partition(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() >= numel and value.numel() > 1


def piece(offset: int, flat: torch.Tensor, moments: dict[str, torch.Tensor], lo: int, n: int) -> dict[str, Any]:
    entry = {"offset": offset, "master": flat[lo : lo + n].float()}
    entry.update({k: v[lo : lo + n].float() for k, v in moments.items()})
    return entry


def converted_head(
    head: dict[str, Any], groups: list[dict[str, Any]], loss_scaler: dict[str, Any] | None
) -> dict[str, Any]:
    """What restore.load reads from rank 0's model file, in the engine's terms."""
    config = head.get("ds_config")
    config = config if isinstance(config, dict) else {}
    steps = int(head.get("global_steps", 0))
    return {
        "engine": {
            "global_steps": steps,
            "global_samples": int(head.get("global_samples", 0)),
            "skipped_steps": int(head.get("skipped_steps", 0)),
            "micro_steps": steps * int(config.get("gradient_accumulation_steps", 1) or 1),
        },
        "lr_scheduler": head.get("lr_scheduler"),
        "loss_scaler": loss_scaler,
        "param_groups": [{k: v for k, v in g.items() if k not in _RUN_SWITCHES} for g in groups],
        "client_state": {k: v for k, v in head.items() if k not in DEEPSPEED_KEYS},
    }


def loss_scaler_state(saved: Any, head: dict[str, Any]) -> dict[str, Any] | None:
    """DeepSpeed's LossScaler / DynamicLossScaler as the engine's LossScaler state dict (the same
    update rule: cur_iter, last_overflow_iter and cur_hysteresis mean what the engine's fields do)."""
    if not isinstance(saved, DeepSpeedObject):
        return None
    return scaler_state(saved, head, bool(saved.get("dynamic", False)), int(saved.get("cur_hysteresis", 1)))


def scaler_state(saved: Any, head: dict[str, Any], dynamic: bool, hysteresis: int) -> dict[str, Any]:
    """The engine's LossScaler state dict from DeepSpeed's cur_scale, cur_iter and last_overflow_iter
    (in `saved`, a LossScaler stand-in or FP16_UnfusedOptimizer's state dict: the same names)."""
    return {
        "dynamic": dynamic,
        "scale": float(saved.get("cur_scale", 1.0)),
        "iterations": int(saved.get("cur_iter", 0)),
        "skipped_steps": int(head.get("skipped_steps", 0)),
        "last_overflow_iter": int(saved.get("last_overflow_iter", -1) if dynamic else -1),
        "hysteresis_left": hysteresis if dynamic else 1,
    }


def aliases_of(head: dict[str, Any]) -> dict[str, str]:
    """Tied parameters: DeepSpeed's shared_params maps each further name to the saved one."""
    shared = head.get("shared_params")
    return {str(k): str(v) for k, v in shared.items()} if isinstance(shared, dict) else {}
