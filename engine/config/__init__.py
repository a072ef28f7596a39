"""DeepSpeed-format config: `load_config` turns a path, dict or base64 JSON into a frozen EngineConfig.

Owns everything between the user's JSON and the typed config the rest of the engine reads (loader.py
runs the phases): reading it (source.py, hjson_decoder.py, nesting.py), checking it (unknown_keys.py,
finite.py, validate.py with schema.json, aliases.py, auto.py, batch.py; run_checks.py for the checks that
need the model or device; paths.py names keys in messages), the support table of what the engine does
with each key (support.py, rows in support_read.py and support_refused.py; docs/config-keys.md is
generated from it), and the frozen dataclasses (types.py) built from the key table (build.py); what
engine.tp_model_init reads of a config given before initialize (tp_model_init.py). Config problems raise
ConfigError (errors.py); keys without effect warn once (warn.py, ConfigWarning).
"""

from engine.config.errors import ConfigError
from engine.config.loader import load_config
from engine.config.source import ConfigSource, read_source
from engine.config.types import (
    BF16Config,
    EngineConfig,
    FP16Config,
    MonitorConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from engine.config.warn import ConfigWarning


def zero_stage(source: ConfigSource) -> int:
    """The ZeRO stage a config asks for, read before the engine exists (e.g. to decide whether to
    build the model under engine.zero.Init); the full validation happens in engine.initialize."""
    zero = read_source(source)[0].get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's legacy "zero_optimization": true means stage 1
        return int(zero)
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # NaN, Infinity, "3": no int() crash
        raise ConfigError(
            f"zero_optimization.stage: {stage!r} is not one of 0, 1, 2, 3; fix: write the ZeRO stage as a number"
        )
    return int(stage)


__all__ = [
    "BF16Config",
    "ConfigError",
    "ConfigWarning",
    "EngineConfig",
    "FP16Config",
    "MonitorConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "ZeroConfig",
    "load_config",
    "zero_stage",
]
