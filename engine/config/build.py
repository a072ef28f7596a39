"""Build the frozen EngineConfig from a validated, canonical config dict.

Runs last, after every check passed, so it only converts: JSON numbers to int/float (DeepSpeed configs
write 5e8 for element counts), nested dicts to read-only mappings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from engine.config.batch import BatchSizes
from engine.config.types import (
    ActivationCheckpointingConfig,
    BF16Config,
    CometConfig,
    EngineConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    WandbConfig,
    ZeroConfig,
)

# Top-level key -> EngineConfig field it is read into (the surface-freeze test checks this against the
# schema, the support table and the dataclass).
FIELD_OF_KEY: dict[str, str] = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "fp16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "gradient_clipping": "gradient_clipping",
    "check_for_nan_in_loss_and_grad": "check_for_nan_in_loss_and_grad",
    "prescale_gradients": "prescale_gradients",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "communication_data_type": "communication_data_type",
    "data_types": "grad_accum_dtype",
    "comms_logger": "comms_logger",
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "memory_breakdown": "memory_breakdown",
    "zero_optimization": "zero",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "csv_monitor": "csv_monitor",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet": "comet",
    "flops_profiler": "flops_profiler",
    "dataloader_drop_last": "dataloader_drop_last",
    "seed": "seed",
    "collectives": "collectives",
    "tensor_parallel": "autotp_size",
    "activation_checkpointing": "activation_checkpointing",
}


def freeze(value: Any) -> Any:
    """Deep read-only copy: dicts -> MappingProxyType, lists -> tuples."""
    if isinstance(value, dict):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _section(cls: type, data: Mapping[str, Any] | None, **overrides: Any) -> Any:
    """Instantiate dataclass `cls` from the keys of `data` it has fields for (others are table-governed)."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: _coerce(v, names[k].type) for k, v in (data or {}).items() if k in names and v is not None}
    kwargs.update(overrides)
    return cls(**kwargs)


def _coerce(value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if isinstance(value, float) and text.startswith("int") and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and text.startswith("float"):
        return float(value)
    return value


def _zero(data: Mapping[str, Any]) -> ZeroConfig:
    offload_optimizer = _section(OffloadConfig, data.get("offload_optimizer"))
    offload_param = _section(OffloadConfig, data.get("offload_param"))
    return _section(ZeroConfig, data, offload_optimizer=offload_optimizer, offload_param=offload_param)


def _named(cls: type, data: Mapping[str, Any] | None) -> Any:
    if not data:
        return None
    return cls(type=data["type"], params=freeze(dict(data.get("params") or {})))


def _dtype_name(name: Any) -> str | None:
    """Canonical short name of a dtype spelling ("float32", "torch.bfloat16", "half", ...)."""
    if not isinstance(name, str):
        return None
    low = name.lower().removeprefix("torch.")
    return {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}.get(low, low)


def build_engine_config(
    config: Mapping[str, Any], sizes: BatchSizes, *, world_size: int, raw: Mapping[str, Any]
) -> EngineConfig:
    comm = config.get("communication_data_type")
    top = {
        k: config[k]
        for k in (
            "gradient_clipping",
            "check_for_nan_in_loss_and_grad",
            "prescale_gradients",
            "gradient_predivide_factor",
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "zero_allow_untested_optimizer",
            "dataloader_drop_last",
            "seed",
            "collectives",
        )
        if config.get(k) is not None
    }
    return _section(
        EngineConfig,
        top,
        train_batch_size=sizes.train,
        train_micro_batch_size_per_gpu=sizes.micro,
        gradient_accumulation_steps=sizes.gas,
        world_size=world_size,
        optimizer=_named(OptimizerConfig, config.get("optimizer")),
        scheduler=_named(SchedulerConfig, config.get("scheduler")),
        fp16=_section(FP16Config, config.get("fp16")),
        bf16=_section(BF16Config, config.get("bf16")),
        communication_data_type=_dtype_name(comm),
        grad_accum_dtype=_dtype_name((config.get("data_types") or {}).get("grad_accum_dtype")),
        comms_logger=bool((config.get("comms_logger") or {}).get("enabled", False)),
        zero=_zero(config.get("zero_optimization") or {}),
        csv_monitor=_section(MonitorConfig, config.get("csv_monitor")),
        tensorboard=_section(MonitorConfig, config.get("tensorboard")),
        wandb=_section(WandbConfig, config.get("wandb")),
        comet=_section(CometConfig, config.get("comet")),
        flops_profiler=_section(FlopsProfilerConfig, config.get("flops_profiler")),
        activation_checkpointing=(_section(ActivationCheckpointingConfig, config["activation_checkpointing"])
                                  if "activation_checkpointing" in config else None),
        autotp_size=max(int((config.get("tensor_parallel") or {}).get("autotp_size") or 0), 1),
        raw=freeze(dict(raw)),
    )
