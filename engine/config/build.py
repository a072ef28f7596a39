"""Build the frozen EngineConfig from a validated, canonical config dict.

Runs last, after every check passed, so it only converts: JSON numbers to int/float (DeepSpeed configs
write 5e8 for element counts), nested dicts to the section dataclasses and read-only mappings. Which key
fills which field is FIELD_OF_KEY and nothing else; how a value is converted follows the field's type.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from engine.config.autotp_specs import read_specs
from engine.config.batch import BatchSizes
from engine.config.types import EngineConfig, OptimizerConfig, SchedulerConfig, TensorParallelConfig

# Top-level key -> EngineConfig field it is read into: the one key -> field mapping, which the build
# follows (the surface-freeze tests check it against the schema, the support table and the dataclass).
# Canonical keys only: engine/config/aliases.py renames the other spellings (bfloat16, ...) first.
FIELD_OF_KEY: dict[str, str] = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "fp16": "fp16",
    "bf16": "bf16",
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
    "aio": "aio",
    "compile": "compile",
    "tensor_parallel": "tensor_parallel",
    "sequence_parallel_size": "sequence_parallel_size",
    "activation_checkpointing": "activation_checkpointing",
}


def freeze(value: Any) -> Any:
    """Deep read-only copy: dicts -> MappingProxyType, lists -> tuples."""
    if isinstance(value, dict):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _dtype_name(name: Any) -> str | None:
    """Canonical short name of a dtype spelling ("float32", "torch.bfloat16", "half", ...)."""
    if not isinstance(name, str):
        return None
    low = name.lower().removeprefix("torch.")
    return {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}.get(low, low)


# Fields whose key's value is not the field's value as it stands: a dtype spelling, or one key of the
# section (DeepSpeed's sections, our flat fields). Every other field converts by its type (_value).
_READ_FIELD: dict[str, Callable[[Any], Any]] = {
    "communication_data_type": _dtype_name,
    "grad_accum_dtype": lambda section: _dtype_name(section.get("grad_accum_dtype")),
    "comms_logger": lambda section: bool(section.get("enabled", False)),
    "tensor_parallel": lambda section: TensorParallelConfig(
        # DeepSpeed's autotp_size 0 (its default) means off, as our 1 does.
        autotp_size=max(int(section.get("autotp_size") or 0), 1),
        specs=read_specs(section),
    ),
    "aio": freeze,
}


def build_engine_config(
    config: Mapping[str, Any], sizes: BatchSizes, *, world_size: int, raw: Mapping[str, Any]
) -> EngineConfig:
    resolved = {**config, **sizes.by_key()}
    fields = {
        field: _READ_FIELD.get(field, _as_written)(resolved[key])
        for key, field in FIELD_OF_KEY.items()
        if resolved.get(key) is not None  # absent or null: the field's default
    }
    return _section(EngineConfig, {**fields, "world_size": world_size, "raw": freeze(dict(raw))})


def _as_written(value: Any) -> Any:
    return value


def _section(cls: type, data: Mapping[str, Any] | None) -> Any:
    """Instantiate dataclass `cls` from the keys of `data` it has fields for (others are table-governed);
    absent and null keys keep the field's default."""
    hints = _hints(cls)
    kwargs = {
        f.name: _value(data[f.name], hints[f.name], f.type)
        for f in dataclasses.fields(cls)
        if data and data.get(f.name) is not None
    }
    return cls(**kwargs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(value: Any, hint: Any, annotation: Any) -> Any:
    """`value` as the field of type `hint` holds it: a section dataclass from a dict, numbers coerced."""
    section = _section_class(hint)
    if section is not None and isinstance(value, section):  # built whole by its _READ_FIELD reader
        return value
    if section in (OptimizerConfig, SchedulerConfig):
        return _named(section, value)
    if section is not None:
        return _section(section, value)
    return _coerce(value, annotation)


def _section_class(hint: Any) -> type | None:
    """The dataclass a field holds (`FP16Config`, `OptimizerConfig | None`), or None for other types."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _named(cls: type, data: Mapping[str, Any]) -> Any:
    """An optimizer or scheduler section: its type and frozen params; an empty section is none."""
    if not data:
        return None
    return cls(type=data["type"], params=freeze(dict(data.get("params") or {})))


def _coerce(value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if isinstance(value, float) and text.startswith("int") and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and text.startswith("float"):
        return float(value)
    return value
