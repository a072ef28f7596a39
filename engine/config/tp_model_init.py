"""What engine.tp_model_init checks of the config it is given, read here because config/ is the only
code that reads config keys. DeepSpeed's tp_model_init(model, tp_size, dtype, config) takes the user's
dict or file before engine.initialize has validated anything, so the sizes are kept as written, for
tp_model_init to judge; an EngineConfig (already validated) gives its typed values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.config.autotp_specs import AutoTPSpecs, read_specs
from engine.config.errors import ConfigError
from engine.config.source import read_source
from engine.config.types import EngineConfig

Precision = Literal["bf16", "fp16"]


@dataclass(frozen=True)
class TPModelInitConfig:
    """The tensor-parallel sizes, precision and layer specs a config gives engine.tp_model_init."""

    sizes: Mapping[str, Any]
    """Key path -> the tensor-parallel size written there, as written (None: absent); each must equal
    tp_model_init's tp_size."""
    precision: Precision | None
    """The enabled 16-bit section ("bf16" wins over "fp16", as in training); None: neither is enabled.
    A dtype given to tp_model_init must be this one."""
    specs: AutoTPSpecs | None
    """tensor_parallel.partition_config / preset_model's layer specs; None: the engine's name rules."""


def tp_model_init_config(config: Any) -> TPModelInitConfig:
    """`config` (a DeepSpeed config dict or path, or an EngineConfig) as tp_model_init checks it."""
    if isinstance(config, EngineConfig):
        return TPModelInitConfig(
            {"tensor_parallel.autotp_size": config.autotp_size},
            "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else None,
            config.tensor_parallel.specs,
        )
    if not isinstance(config, (Mapping, str, os.PathLike)):
        raise ConfigError(
            f"tp_model_init: config must be a DeepSpeed config dict or path, or an EngineConfig; "
            f"got {type(config).__name__}"
        )
    raw, _ = read_source(dict(config) if isinstance(config, Mapping) else config)
    section = raw.get("tensor_parallel")
    sizes = {
        "tensor_parallel.autotp_size": (section or {}).get("autotp_size"),
        "tensor_parallel.tp.tp_size": ((section or {}).get("tp") or {}).get("tp_size"),
    }
    bf16 = (raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled") is True
    fp16 = (raw.get("fp16") or {}).get("enabled") is True
    precision: Precision | None = "bf16" if bf16 else "fp16" if fp16 else None
    return TPModelInitConfig(sizes, precision, read_specs(section if isinstance(section, Mapping) else None))
