"""A JSON-configured ZeRO training engine for PyTorch; `import engine as deepspeed` works for the
features it supports.

    engine, optimizer, loader, scheduler = engine.initialize(model=model, config="configs/zero0.json")
"""

import sys

from engine import activation_checkpointing, zero
from engine.comm import comm_stats, init_distributed
from engine.config import ConfigError, EngineConfig, load_config
from engine.initialize import add_config_arguments, initialize
from engine.parallel.autotp import tp_model_init
from engine.precision import NonFiniteGradientError
from engine.runtime.engine import Engine

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "NonFiniteGradientError",
    "add_config_arguments",
    "checkpointing",
    "comm_stats",
    "estimate_memory",
    "init_distributed",
    "initialize",
    "load_config",
    "tp_model_init",
    "zero",
]
__version__ = "0.1.0"

# DeepSpeed's name for activation checkpointing is `deepspeed.checkpointing`, and `import engine as
# deepspeed` must keep `deepspeed.checkpointing.checkpoint` and `import engine.checkpointing` working; the
# package itself is named for what it holds (engine/checkpoint/ is the model checkpoints).
checkpointing = activation_checkpointing
sys.modules[f"{__name__}.checkpointing"] = activation_checkpointing


def __getattr__(name: str) -> object:  # lazy: training never needs the estimator, so `import engine` skips it
    if name == "estimate_memory":
        from engine.estimate import estimate_memory

        return estimate_memory
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
