"""Config checks that need more than the config: the arguments of engine.initialize, the device, the
optimizer object, the model. Like every other config check they raise ConfigError (engine/config/
errors.py), naming the key and the fix; engine.initialize and the stages call them, so a config
problem is never a ValueError from deep inside a stage.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from engine.config.errors import ConfigError
from engine.config.types import EngineConfig
from engine.config.warn import warn_once

logger = logging.getLogger("engine.config")

ELEMENTWISE_OPTIMIZERS = frozenset(
    {
        # torch.optim and the engine's own (engine/optim, engine/ops/adam.py)
        "Adam",
        "AdamW",
        "SGD",
        "Adagrad",
        "RMSprop",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "ASGD",
        "Lion",
        "ReferenceAdam",
        "CPUAdam",
        # DeepSpeed's classes under their own names (engine/optim/deepspeed_classes.py, deepspeed.ops.*): the
        # ones DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS lists (runtime/zero/utils.py) that this engine provides
        "DeepSpeedCPUAdam",
        "FusedAdam",
        "DeepSpeedCPUAdagrad",
        "DeepSpeedCPULion",
    }
)
"""Optimizer class names (type(optimizer).__name__) whose update is elementwise, so running them on a flat
shard that mixes parameters equals running them per parameter. Per-tensor statistics (LAMB's trust ratio,
so Lamb and DeepSpeed's FusedLamb; LARS; Adafactor's factored moments) would silently change meaning on a
shard, so they stay refused at stages 1-3."""


def config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config initialize() was given: config=, config_params=, or args.deepspeed_config/args.config
    (DeepSpeed's deprecated args.deepscale_config moved onto args.deepspeed_config first)."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize() got both config= and config_params=; pass the config once")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        _move_deepscale_config(args)
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "config", None)
    if config is not None and from_args is not None:
        raise ConfigError(
            f"the config was given twice: as initialize(config=...) and as args ({from_args!r}); remove one of them"
        )
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError(
            "no config: pass initialize(config='x.json' or a dict), or args with --deepspeed_config x.json"
        )
    return source


def _move_deepscale_config(args: Any) -> None:
    """DeepSpeed's deprecated --deepscale_config, as deepspeed.initialize reads it: with a warning, moved onto
    args.deepspeed_config (args.deepscale_config set to None); refused when args has both."""
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is None:
        return
    current = getattr(args, "deepspeed_config", None)
    if current is not None:
        raise ConfigError(
            f"args has both deepscale_config ({deepscale!r}) and deepspeed_config ({current!r}): "
            "--deepscale_config is the deprecated name of --deepspeed_config; pass only --deepspeed_config"
        )
    warn_once(
        "args.deepscale_config",
        "--deepscale_config (args.deepscale_config) is deprecated, as in DeepSpeed; use --deepspeed_config",
        rank_zero_only=True,
    )
    args.deepspeed_config = deepscale
    args.deepscale_config = None


def check_stage(cfg: EngineConfig, implemented: Collection[int]) -> None:
    if cfg.zero.stage not in implemented:
        raise ConfigError(
            f"zero_optimization.stage: {cfg.zero.stage} is not implemented yet; use one of {sorted(implemented)}"
        )


def check_offload(cfg: EngineConfig, device_type: str) -> None:
    """zero_optimization.offload_optimizer and offload_param against the stage and the training device."""
    _check_optimizer_offload(cfg, device_type)
    _check_param_offload(cfg, device_type)


def _check_optimizer_offload(cfg: EngineConfig, device_type: str) -> None:
    if cfg.zero.offload_optimizer.device != "cpu":
        return
    if cfg.zero.stage == 0:
        raise ConfigError(
            'zero_optimization.offload_optimizer.device "cpu" needs zero_optimization.stage 1, 2 or 3 '
            "(ZeRO-Offload steps the partitioned optimizer); raise the stage or remove offload_optimizer"
        )
    if device_type != "cpu":
        raise ConfigError(
            f'zero_optimization.offload_optimizer.device "cpu" while training on {device_type} is not '
            "implemented yet (only CPU training runs the fused offload step); remove offload_optimizer"
        )


def _check_param_offload(cfg: EngineConfig, device_type: str) -> None:
    """offload_param "cpu" ("nvme" is engine/offload/nvme_setup.py's). DeepSpeed reads it only at stage 3 (its
    stage 1-2 optimizer never sees it; runtime/zero/offload_config.py: "Valid only with stage 3"), so at
    stages 0-2 it is ignored as there, by name. At stage 3 on CPU the partitions are in host memory already."""
    if cfg.zero.offload_param.device != "cpu":
        return
    stage = cfg.zero.stage
    if stage != 3:
        warn_once(
            "zero_optimization.offload_param",
            f'zero_optimization.offload_param.device "cpu" is ignored at zero_optimization.stage {stage}, as '
            "DeepSpeed ignores it there: only stage 3 partitions parameters, so only stage 3 can offload "
            "them; remove offload_param, or use stage 3",
            rank_zero_only=True,
        )
        return
    if device_type != "cpu":
        raise ConfigError(
            f'zero_optimization.offload_param.device "cpu" while training on {device_type}: parameter '
            "offload to host memory on a CUDA device has not been tested on a GPU yet; fix: remove "
            "offload_param, or train on CPU"
        )
    logger.info(
        'zero_optimization.offload_param.device "cpu" at stage 3 on CPU: the partitioned parameters already '
        "live in host memory (each rank keeps its 1/%d of every parameter there and gathers a unit only for "
        "its forward and backward), so parameter offload changes nothing here; pin_memory, buffer_count, "
        "buffer_size and max_in_cpu have no effect",
        cfg.world_size,
    )


def check_optimizer_for_stage(cfg: EngineConfig, optimizer_name: str) -> None:
    """Stages 1-3 step flat shards that mix parameters: only an elementwise optimizer means the same there."""
    stage = cfg.zero.stage
    if stage == 0 or optimizer_name in ELEMENTWISE_OPTIMIZERS or cfg.zero_allow_untested_optimizer:
        return
    raise ConfigError(
        f"optimizer {optimizer_name} at zero_optimization.stage {stage}: the partitioned stages run the optimizer "
        f"on flat shards that mix parameters, which is only equivalent for elementwise optimizers "
        f"({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}); {optimizer_name} is not one of them, and an optimizer "
        "with per-tensor statistics (LAMB's trust ratio) would compute them over the shard instead. Use one of "
        'those, zero_optimization.stage 0, or set "zero_allow_untested_optimizer": true if you know it is '
        "elementwise"
    )


def check_leaf_module(leaf_module: Mapping[str, Any] | None, model_name: str, matched: bool) -> None:
    """zero_optimization.leaf_module must name at least one submodule of the model."""
    if leaf_module and not matched:
        raise ConfigError(
            f"zero_optimization.leaf_module {dict(leaf_module)} matches no submodule of {model_name}; "
            "name classes (type(m).__name__), module names or name suffixes as in "
            "model.named_modules()"
        )


def check_init_stage(stage: int) -> None:
    """engine.zero.Init(config_dict_or_path=...) builds partitioned parameters, which only stage 3 keeps."""
    if stage != 3:
        raise ConfigError(
            f"engine.zero.Init partitions parameters for zero_optimization.stage 3, but the "
            f"config has stage {stage}; set it to 3 or build the model without Init "
            "(enabled=False)"
        )
