"""Which tensor x data-parallel groups an engine trains over, from what the user gave initialize().

Three sources, in this order (DeepSpeed's, for the cases this engine has):
  1. `mpu=` (a Megatron-style object, or the engine.parallel module): its groups, checked
     (engine/parallel/user_mpu.py); a config `tensor_parallel.autotp_size` must then agree with it.
  2. The config's `tensor_parallel.autotp_size` > 1: the engine makes the groups
     (initialize_model_parallel) and AutoTP shards the model's nn.Linear layers unless
     engine.tp_model_init already did.
  3. Groups made earlier by engine.parallel.initialize_model_parallel(tp) with tp > 1 (a model built
     from engine.parallel's layers needs them): those, as if passed as mpu.
Otherwise the whole world is the data-parallel group. Sequence parallelism (the config's
sequence_parallel_size, or groups engine.parallel.initialize_sequence_parallel made, which DeepSpeed's
sequence-only mpu from register_with_transformers stands for) keeps the whole world as ZeRO's group and
adds the sequence-parallel group (engine/parallel/sequence_groups.py).

ZeRO partitions over the data-parallel group, so batch arithmetic, the data each rank reads and the
gradient averaging all use the data-parallel size (paper sections 2 and 8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.config.errors import ConfigError
from engine.parallel.groups import ParallelGroups, initialize_model_parallel, model_parallel_is_initialized
from engine.parallel.groups import groups as current_groups
from engine.parallel.layers import is_tensor_parallel
from engine.parallel.sequence_groups import initialize_sequence_parallel, sequence_groups
from engine.parallel.user_mpu import groups_from_mpu
from engine.zero import partitioned_init


def _sequence_only(mpu: Any) -> bool:
    """DeepSpeed's parallel_state_sp (what UlyssesSPAttentionHF.register_with_transformers returns): sequence
    groups only, no Megatron data/model groups."""
    return hasattr(mpu, "get_sequence_parallel_world_size") and not hasattr(mpu, "get_data_parallel_group")


def sequence_parallel_before_config(mpu: Any) -> int | None:
    """The sequence-parallel size of groups made before initialize (by mpu=, or
    engine.parallel.initialize_sequence_parallel), or None (the config's sequence_parallel_size decides).
    Only groups engine.parallel made are used: their traffic is counted and their layout is the engine's."""
    made = sequence_groups()
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        size = int(mpu.get_sequence_parallel_world_size())
        foreign = size > 1 and (
            made is None
            or made.size != size
            or (hasattr(mpu, "get_sequence_parallel_group") and mpu.get_sequence_parallel_group() is not made.group)
        )
        if foreign:
            raise ConfigError(
                f"mpu= has sequence-parallel groups (size {size}) that engine.parallel did not make; make them "
                "with engine.parallel.initialize_sequence_parallel(size) (or UlyssesSPAttentionHF."
                "register_with_transformers, which does), or set sequence_parallel_size in the config"
            )
        return size if size > 1 else None
    return made.size if made is not None and made.size > 1 else None


def groups_before_config(mpu: Any) -> ParallelGroups | None:
    """The groups known before the config is read (sources 1 and 3), or None (the config decides)."""
    if mpu is not None and not _sequence_only(mpu):
        return groups_from_mpu(mpu)
    if model_parallel_is_initialized() and current_groups().tp_size > 1:
        return current_groups()
    return None


def resolve_groups(
    known: ParallelGroups | None, autotp_size: int, model: torch.nn.Module, config: Any = None
) -> ParallelGroups:
    """The groups to train over (every rank calls it at the same point: it may make process groups),
    with AutoTP applied to `model` when the config asks for it (by its layer specs when `config`, the
    EngineConfig, has tensor_parallel.partition_config or preset_model)."""
    groups = _resolve(known, autotp_size, model, config)
    sp = getattr(config, "sequence_parallel_size", 1)
    if sp > 1:  # load_config refused it with tensor parallelism: ZeRO's group is the whole world
        made = initialize_sequence_parallel(sp)
        groups = dataclasses.replace(groups, sp_size=sp, sp_group=made.group, sp_rank=made.rank)
    if groups.tp_size > 1:
        built_partitioned = next((n for n, p in model.named_parameters() if partitioned_init.is_partitioned(p)), None)
        if built_partitioned is not None:
            raise ConfigError(
                f"parameter {built_partitioned!r} was built under engine.zero.Init, which partitions "
                f"over the whole world, but tensor parallelism (size {groups.tp_size}) partitions ZeRO "
                "over the data-parallel group only: build the model without engine.zero.Init (stage 3 "
                "still partitions it at initialize)"
            )
    return groups


def _resolve(known: ParallelGroups | None, autotp_size: int, model: torch.nn.Module, config: Any) -> ParallelGroups:
    if known is not None:
        if autotp_size > 1 and autotp_size != known.tp_size:
            raise ConfigError(
                f"tensor_parallel.autotp_size is {autotp_size} but the model-parallel groups (mpu= or "
                f"engine.parallel.initialize_model_parallel) have tensor-parallel size {known.tp_size}; "
                "make them equal or drop tensor_parallel.autotp_size"
            )
        if autotp_size > 1:
            parsed = getattr(model, "ds_autotp_parsed", False)
            if not parsed and not (model_parallel_is_initialized() and current_groups() == known):
                raise ConfigError(
                    "tensor_parallel.autotp_size with a user's mpu= object: AutoTP shards the model over "
                    "engine.parallel's own tensor-parallel groups, not the mpu's; pass mpu=engine.parallel "
                    "(after engine.parallel.initialize_model_parallel), or shard the model yourself and "
                    "drop tensor_parallel.autotp_size"
                )
            _apply_autotp(model, autotp_size, config)
        return known
    if autotp_size > 1:
        groups = initialize_model_parallel(autotp_size)
        _apply_autotp(model, autotp_size, config)
        return groups
    marked = next((n for n, p in model.named_parameters() if is_tensor_parallel(p)), None)
    if marked is not None and not model_parallel_is_initialized():
        raise ConfigError(
            f"parameter {marked!r} is a tensor-parallel slice (tensor_model_parallel=True) but no "
            "model-parallel groups are known: pass mpu= to engine.initialize(), or call "
            "engine.parallel.initialize_model_parallel(tp) before building the model"
        )
    return ParallelGroups.data_parallel_only()


def _apply_autotp(model: torch.nn.Module, tp_size: int, config: Any) -> None:
    """Shard the model, or (sharded by engine.tp_model_init already) check it was sharded as `config` says."""
    from engine.parallel.autotp import tp_model_init  # AutoTP's rule tables load only when asked for

    tp_model_init(model, tp_size, config=config)
