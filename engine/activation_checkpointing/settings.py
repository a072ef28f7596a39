"""What engine.checkpointing does with a checkpoint's inputs, and where it was told so.

One process-wide setting, as DeepSpeed's deepspeed.checkpointing: `configure()` sets it (Megatron calls
`configure(mpu, deepspeed_config=...)`), engine.initialize sets it from the config's
`activation_checkpointing` section unless the user configured it themselves, and `reset()` drops the
contiguous arena between evaluation forwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from engine import comm
from engine.activation_checkpointing import contiguous, ledger
from engine.comm import ProcessGroup
from engine.config.errors import ConfigError
from engine.config.types import ActivationCheckpointingConfig, EngineConfig
from engine.parallel.groups import ParallelGroups

logger = logging.getLogger("engine.checkpointing")

SECTION = "activation_checkpointing"


@dataclass(frozen=True)
class TensorParallel:
    """The group a checkpoint's inputs are partitioned over (P_a): the tensor-parallel group."""

    size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None


@dataclass(frozen=True)
class Settings:
    options: ActivationCheckpointingConfig
    tensor_parallel: TensorParallel
    configured_by: str
    """"user" (configure()), "engine" (initialize, from the config) or "" (defaults, never configured)."""

    @property
    def partitions(self) -> bool:
        """P_a applies: asked for, and there is a tensor-parallel group to partition over."""
        return self.options.partition_activations and self.tensor_parallel.size > 1


_DEFAULTS = Settings(ActivationCheckpointingConfig(), TensorParallel(), "")
_settings = _DEFAULTS
_said: set[str] = set()


def current() -> Settings:
    return _settings


def say_once(key: str, message: str) -> None:
    """Log `message` once per process (per configure)."""
    if key not in _said:
        _said.add(key)
        logger.warning(message)


def say_if_nothing_to_partition(settings: Settings) -> None:
    """partition_activations without tensor parallelism: said once, and checkpoints are kept whole."""
    if settings.options.partition_activations and not settings.partitions:
        say_once(
            "no-tp",
            f"{SECTION}.partition_activations is set but there is no tensor parallelism (the "
            "tensor-parallel size is 1), so checkpoints are kept whole; partitioning needs "
            "tensor_parallel.autotp_size or mpu= with a tensor-parallel size above 1",
        )


def tensor_parallel_of(mpu: Any) -> TensorParallel:
    """The tensor-parallel group of `mpu`: engine.parallel's ParallelGroups, the engine.parallel module or
    a user's Megatron-style object (get_tensor_model_parallel_* or the older get_model_parallel_*)."""
    if mpu is None:
        return TensorParallel()
    if isinstance(mpu, ParallelGroups):
        return TensorParallel(mpu.tp_size, mpu.tp_rank, mpu.tp_group)
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        methods: list[Any] = [getattr(mpu, prefix + m, None) for m in ("world_size", "rank", "group")]
        if all(callable(m) for m in methods):
            size, rank, group = (m() for m in methods)
            if size > 1 and group is not None:
                comm.adopt_group(group, "tp")  # usable by every collective implementation, counted as TP
            return TensorParallel(int(size), int(rank), group if size > 1 else None)
    name = getattr(mpu, "__name__", type(mpu).__name__)
    raise ConfigError(
        f"engine.checkpointing.configure(mpu_={name}): it has neither get_tensor_model_parallel_"
        "world_size/rank/group nor get_model_parallel_world_size/rank/group; pass engine.parallel "
        "(after engine.parallel.initialize_model_parallel(tp)) or None"
    )


def _from_config(deepspeed_config: Any, tensor_parallel: TensorParallel) -> ActivationCheckpointingConfig:
    """The activation_checkpointing section of a config: an EngineConfig, or anything load_config reads
    (a path, a dict), validated as a whole, as DeepSpeed builds a whole DeepSpeedConfig."""
    if isinstance(deepspeed_config, EngineConfig):
        return deepspeed_config.activation_checkpointing or ActivationCheckpointingConfig()
    from engine.config.loader import load_config

    world = comm.get_world_size() if comm.is_initialized() else 1
    loaded = load_config(
        deepspeed_config,
        world_size=world,
        world_size_source="engine.checkpointing.configure",
        model_parallel_size=tensor_parallel.size,
    )
    return loaded.activation_checkpointing or ActivationCheckpointingConfig()


def check_options(options: ActivationCheckpointingConfig | None) -> None:
    """ConfigError for settings that cannot work (initialize checks the config's section with it before
    the ranks agree, so every rank raises it together)."""
    if options is not None and options.contiguous_memory_optimization and not options.number_checkpoints:
        raise ConfigError(
            f"{SECTION}.contiguous_memory_optimization needs {SECTION}.number_checkpoints (the "
            "checkpoints alive at once in one forward, usually the number of checkpointed layers) "
            f"to size its arena; it is {options.number_checkpoints!r}. Set it, or "
            "configure(num_checkpoints=N)"
        )


def check_engine_options(config: EngineConfig) -> None:
    """What engine.initialize checks: the config's section, unless the user called configure() before
    initialize (Megatron's order): their settings take precedence and configure_from_engine leaves them,
    so the section they override must not be refused (contiguous_memory_optimization without
    number_checkpoints, given to configure(num_checkpoints=N), is a working setup)."""
    if _settings.configured_by != "user":
        check_options(config.activation_checkpointing)


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    configured_by: str = "user",
) -> None:
    """DeepSpeed's deepspeed.checkpointing.configure: start from the defaults, read the config's
    activation_checkpointing section when `deepspeed_config` is given, then let each argument that is
    not None override its key. A failed call leaves the previous setting in place."""
    global _settings
    tensor_parallel = tensor_parallel_of(mpu_)
    options = (
        _from_config(deepspeed_config, tensor_parallel)
        if deepspeed_config is not None
        else ActivationCheckpointingConfig()
    )
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    options = replace(options, **{k: v for k, v in overrides.items() if v is not None})
    check_options(options)
    reset()
    _said.clear()
    _settings = Settings(options, tensor_parallel, configured_by)
    say_if_nothing_to_partition(_settings)
    if not comm.is_initialized() or comm.get_rank() == 0:
        logger.info(
            "activation checkpointing: partition_activations=%s (tensor-parallel size %d), "
            "cpu_checkpointing=%s, contiguous_memory_optimization=%s, number_checkpoints=%s, "
            "synchronize=%s, profile=%s (configured by %s)",
            options.partition_activations,
            tensor_parallel.size,
            options.cpu_checkpointing,
            options.contiguous_memory_optimization,
            options.number_checkpoints,
            options.synchronize_checkpoint_boundary,
            options.profile,
            configured_by,
        )


def configure_from_engine(config: EngineConfig, parallel: Any) -> None:
    """engine.initialize: the config's section, over the engine's tensor-parallel group, unless the user
    called configure() themselves (Megatron does, before initialize) or the config has no section."""
    if config.activation_checkpointing is None or _settings.configured_by == "user":
        return
    configure(parallel, deepspeed_config=config, configured_by="engine")


def is_configured() -> bool:
    return _settings.configured_by != ""


def unconfigure() -> None:
    """Back to the defaults, as if configure() had never been called (tests; a new run in one process)."""
    global _settings
    reset()
    _said.clear()
    _settings = _DEFAULTS


def reset() -> None:
    """DeepSpeed's reset(): drop the contiguous arena and start counting afresh. Call it between
    forwards that have no backward (evaluation) when their checkpoints were kept; a forward under
    torch.no_grad() keeps none, so it needs no reset."""
    contiguous.drop()
    ledger.reset_peak()
