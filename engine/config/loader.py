"""load_config: read, validate and resolve a DeepSpeed-format config into a frozen EngineConfig.

Every check runs even when an earlier one failed (bad values are dropped first so later checks see only
well-typed data), and all problems are raised together as one ConfigError: a user fixes them in one run.
Phases: read -> ignored top-level keys -> finite numbers -> schema -> aliases -> "auto" -> batch sizes -> support table -> build.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

from engine.config import paths
from engine.config.aliases import normalize
from engine.config.auto import resolve_auto
from engine.config.autotp_specs import read_specs
from engine.config.batch import GAS, MICRO, TRAIN, BatchSizes, TensorParallel, resolve_batch_sizes
from engine.config.build import build_engine_config
from engine.config.errors import ConfigError
from engine.config.finite import check_finite
from engine.config.source import DICT_SOURCE, ConfigSource, read_source, stack_backstop
from engine.config.support import check_support
from engine.config.types import EngineConfig
from engine.config.unknown_keys import Ignored, drop_ignored_keys
from engine.config.validate import check_schema, top_level_keys
from engine.config.warn import warn_once

logger = logging.getLogger("engine.config")


@stack_backstop
def load_config(
    source: ConfigSource,
    *,
    world_size: int,
    world_size_source: str,
    model_parallel_size: int | None = None,
    sequence_parallel_size: int | None = None,
    given_objects: frozenset[str] = frozenset(),
) -> EngineConfig:
    """Load `source` (a path, a dict, or base64 of a JSON object) for `world_size` ranks.

    `world_size_source` says where the world size came from (e.g. "WORLD_SIZE env (torchrun)"); batch-size
    errors quote it. The tensor-parallel size is `model_parallel_size` (from mpu= or groups made before)
    or else the config's tensor_parallel.autotp_size; the resolved train_batch_size counts data-parallel
    ranks (the world over it), a written one is read as DeepSpeed reads it (engine/config/batch.py). The
    sequence-parallel size is `sequence_parallel_size` (groups made before) or the config's key: batch
    sizes then count world // sp replicas, as Accelerate writes them.
    `given_objects` names the sections ("optimizer", "scheduler") engine.initialize got an object or
    callable for: as in DeepSpeed, that object takes precedence and the config's section is ignored
    unchecked (Megatron passes its own optimizer beside configs whose optimizer section DeepSpeed would
    refuse to build, e.g. with params.max_grad_norm), with a warning naming it; engine.config keeps it.
    Raises ConfigError listing every problem found.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r} (from {world_size_source})")
    kept, where = read_source(source)
    raw, overridden = _set_aside_given_sections(kept, given_objects)
    # First: keys DeepSpeed ignores are ignored here too, whatever they hold (see engine/config/unknown_keys.py).
    ignored = drop_ignored_keys(raw, top_level_keys()) if isinstance(raw, dict) else Ignored()
    # Before the schema: NaN passes its range checks, and Infinity's documented meanings must be in place.
    raw, problems = check_finite(raw)
    schema_problems, bad_paths = check_schema(raw)
    problems += schema_problems
    if any(not p for p in bad_paths):  # the root itself is unusable; nothing more to check
        raise ConfigError(_located(problems, where))

    config = copy.deepcopy(raw)
    for path in sorted(bad_paths, key=len, reverse=True):
        paths.delete(config, path)

    aliases = normalize(config)
    problems += aliases.problems
    auto = resolve_auto(config)
    problems += auto.problems
    tensor_parallel, tp_problems = _tensor_parallel(config, world_size, world_size_source, model_parallel_size)
    problems += tp_problems
    sp, sp_problems = _sequence_parallel(config, world_size, sequence_parallel_size, tensor_parallel)
    problems += sp_problems
    problems += _hierarchical_partition(config, world_size, sp, tensor_parallel)
    if sp > 1:  # every batch key counts the replicas of a sample, as Accelerate writes them
        world_size, world_size_source = world_size // sp, f"{world_size_source}, over sequence_parallel_size {sp}"
    problems += _autotp_spec_problems(config)
    sizes, notes, batch_problems = _batch_sizes(config, auto.batch_auto, world_size, world_size_source, tensor_parallel)
    problems += batch_problems
    refusals, warnings_ = check_support(config, aliases.origins)
    problems += refusals
    problems += _check_precision(config)

    if problems or sizes is None:
        raise ConfigError(_located(problems, where))
    for note in notes:
        logger.info("%s", note)
    for key in sorted(auto.batch_auto):
        logger.info(
            '%s: "auto" resolved to %s from the other batch keys',
            key,
            sizes.by_key()[key],
        )
    for key, message in aliases.deprecations + warnings_:
        warn_once(key, message)
    for key, message in ignored.warnings:
        warn_once(key, message, rank_zero_only=True)
    _warn_given_sections(overridden, kept)
    if overridden:
        raw = {**raw, **{name: kept[name] for name in overridden}}  # engine.config shows the user's whole config
    dp_size = world_size // tensor_parallel.size if tensor_parallel else world_size
    built = build_engine_config(config, sizes, world_size=dp_size, raw=raw)
    return dataclasses.replace(built, sequence_parallel_size=sp)


def _hierarchical_partition(
    config: dict[str, Any], world_size: int, sp: int, tensor_parallel: TensorParallel | None
) -> list[str]:
    """ZeRO++'s hpZ (zero_optimization.zero_hpz_partition_size k): each group of k consecutive ranks keeps a
    secondary shard of every unit gathered in a forward, for the backward's all-gather to stay inside it
    (engine/zero/stage3/secondary.py). k must divide the world and the ranks per node (LOCAL_WORLD_SIZE), so
    no group spans two nodes."""
    zero = config.get("zero_optimization") or {}
    k = zero.get("zero_hpz_partition_size", 1) if isinstance(zero, dict) else 1
    if not isinstance(k, int) or isinstance(k, bool) or k <= 1:
        return []
    where = f"zero_optimization.zero_hpz_partition_size {k}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    problems = []
    if zero.get("stage") != 3:
        problems.append(f"{where}: hierarchical partitioning is a stage-3 feature; set stage 3 or remove the key")
    if world_size % k or per_node % k:
        sizes = [d for d in range(2, per_node + 1) if per_node % d == 0 and world_size % d == 0]
        problems.append(
            f"{where} must divide the world size {world_size} and the ranks per node {per_node} (a group of "
            f"consecutive ranks inside one node); use one of {sizes or [1]}"
        )
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key) or {}
        if isinstance(section, dict) and section.get("device", "none") not in ("none", None):
            problems.append(f"{where} with zero_optimization.{key}: not implemented together; use one of them")
    if sp > 1 or tensor_parallel is not None:
        problems.append(f"{where} with sequence or tensor parallelism: not implemented together; use one of them")
    return problems


def _sequence_parallel(
    config: dict[str, Any], world_size: int, known: int | None, tensor_parallel: TensorParallel | None
) -> tuple[int, list[str]]:
    """(the sequence-parallel size, problems): the groups made before initialize, else the config's key."""
    key = config.get("sequence_parallel_size")
    written = key if isinstance(key, int) and not isinstance(key, bool) else None
    sp = known or written or 1
    problems = []
    if known and written and known != written:
        problems.append(
            f"sequence_parallel_size is {written} but the sequence-parallel groups made before initialize "
            f"(UlyssesSPAttentionHF.register_with_transformers, or mpu=) have size {known}; make them equal or "
            "remove the key"
        )
    if sp > 1 and tensor_parallel is not None:
        problems.append(
            f"sequence_parallel_size {sp} with tensor parallelism (size {tensor_parallel.size}, from "
            f"{tensor_parallel.source}): the two together are not implemented; use one of them"
        )
    if sp > 1 and world_size % sp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        problems.append(
            f"sequence_parallel_size {sp} does not divide the world size {world_size}: each sample's tokens are "
            f"split over sp consecutive ranks; use one of {divisors}"
        )
    return sp, problems


def _set_aside_given_sections(raw: dict[str, Any], given_objects: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """(`raw` without the sections engine.initialize was given an object for, their names): those go
    unchecked, as in DeepSpeed, where the object takes precedence."""
    if not isinstance(raw, dict) or not any(name in raw for name in given_objects):
        return raw, []
    overridden: list[str] = [name for name in ("optimizer", "scheduler") if name in given_objects and name in raw]
    return {k: v for k, v in raw.items() if k not in overridden}, overridden


def _warn_given_sections(overridden: list[str], kept: dict[str, Any]) -> None:
    """Once per section set aside: the user's config has it (`kept`: as written), and it is ignored."""
    for name in overridden:
        kind = "lr_scheduler" if name == "scheduler" else name
        warn_once(
            name,
            f"the config's {name} section (type {paths.get(kept, (name, 'type'))!r}) is ignored: "
            f"engine.initialize() was given {kind}=, which takes precedence, as in DeepSpeed; remove one of "
            "them to silence this",
            rank_zero_only=True,
        )


def _autotp_spec_problems(config: dict[str, Any]) -> list[str]:
    """What the engine cannot do of tensor_parallel.partition_config / preset_model, found at load
    (AutoTP reads them again when it shards the model)."""
    section = config.get("tensor_parallel")
    try:
        read_specs(section if isinstance(section, dict) else None)
    except ConfigError as e:
        return e.problems
    return []


def _tensor_parallel(
    config: dict[str, Any], world_size: int, world_size_source: str, model_parallel_size: int | None
) -> tuple[TensorParallel | None, list[str]]:
    """(the tensor-parallel size batch sizes are read with, or None without one; problems)."""
    autotp = paths.get(config, ("tensor_parallel", "autotp_size"))
    tp = model_parallel_size or (autotp if isinstance(autotp, int) and not isinstance(autotp, bool) else 1)
    if tp <= 1:
        return None, []
    said = (
        "the model-parallel groups (mpu=, or made before initialize)"
        if model_parallel_size
        else "tensor_parallel.autotp_size"
    )
    if world_size % tp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        problem = (
            f"tensor_parallel.autotp_size: tensor-parallel size {tp} (from {said}) does not divide the world "
            f"size {world_size} ({world_size_source}); use one of {divisors}"
        )
        return None, [problem]
    return TensorParallel(tp, said, from_config=not model_parallel_size), []


def _batch_sizes(
    config: dict[str, Any],
    batch_auto: set[str],
    world_size: int,
    world_size_source: str,
    tensor_parallel: TensorParallel | None,
) -> tuple[BatchSizes | None, list[str], list[str]]:
    """(sizes, notes, problems); "auto" batch keys were removed from `config` and are inferred here."""
    if batch_auto and config.get(TRAIN) is None and config.get(MICRO) is None:
        # Nothing to infer from: name the "auto" keys rather than report missing batch sizes.
        return (
            None,
            [],
            [
                f'{key}: "auto" can only be filled in by the Hugging Face Trainer and cannot be inferred '
                "from the other batch keys here; write a number"
                for key in sorted(batch_auto)
            ],
        )
    sizes, problems, notes = resolve_batch_sizes(
        _int_or_none(config.get(TRAIN)),
        _int_or_none(config.get(MICRO)),
        _int_or_none(config.get(GAS)),
        world_size=world_size,
        world_size_source=world_size_source,
        tensor_parallel=tensor_parallel,
    )
    return sizes, notes, problems


def _int_or_none(value: Any) -> int | None:
    """Batch keys passed the schema's integer check, which admits integral floats such as 8.0."""
    return None if value is None else int(value)


def _check_precision(config: dict[str, Any]) -> list[str]:
    fp16 = paths.get(config, ("fp16", "enabled")) is True
    bf16 = paths.get(config, ("bf16", "enabled")) is True
    if fp16 and bf16:
        return [
            "fp16.enabled and bf16.enabled are both true; DeepSpeed refuses this too; fix: keep at most one enabled"
        ]
    return []


def _located(problems: list[str], where: str) -> list[str]:
    """Prefix each problem with the file it came from (not for dicts), unless it already names it."""
    if where == DICT_SOURCE:
        return problems
    return [p if p.startswith(where) else f"{where}: {p}" for p in problems]
