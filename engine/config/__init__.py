"""DeepSpeed-format config: `load_config` turns a path, dict or base64 JSON into a frozen EngineConfig.

See engine/config/support.py for what the engine does with each key, and docs/config-keys.md.
"""

from engine.config.errors import ConfigError
from engine.config.loader import load_config
from engine.config.types import (
    BF16Config,
    EngineConfig,
    FP16Config,
    MonitorConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from engine.config.warn import ConfigWarning

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
    "ZeroConfig",
    "load_config",
]
