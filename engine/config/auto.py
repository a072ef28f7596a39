"""Resolve or refuse the string "auto" (a Hugging Face Trainer convention).

The HF Trainer replaces "auto" with real values before DeepSpeed sees the config. Without it:
- batch sizes marked "auto" are inferred from the other batch keys (engine/config/batch.py);
- sizes and thresholds inside zero_optimization take DeepSpeed's default, as DeepSpeed's nested
  config models drop "auto" values; we log which default was used;
- anywhere else (optimizer/scheduler params, gradient_clipping, fp16/bf16 enabled, ...) there is no
  sound default, so the key is refused by name.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from engine.config.paths import dotted
from engine.config.types import ARENA_AUTO, DEEPSPEED_BUCKET_SIZE

logger = logging.getLogger("engine.config")

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# DeepSpeed's defaults (runtime/zero/config.py, offload_config.py), element counts.
ZERO_AUTO_DEFAULTS: dict[str, int | bool] = {
    "reduce_bucket_size": DEEPSPEED_BUCKET_SIZE,
    "allgather_bucket_size": DEEPSPEED_BUCKET_SIZE,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": sys.maxsize,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_module_granularity_threshold": 0,
    "stage3_gather_16bit_weights_on_model_save": False,
    "stage3_arena_bytes": ARENA_AUTO,  # ours: "auto" sizes the arena from the model; absent: off
}
OFFLOAD_PARAM_AUTO_DEFAULTS: dict[str, int] = {"buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}

# Sections that DeepSpeed hands to sub-systems where "auto" can be a real value (pipeline.stages is
# "auto" by default); the support table decides about these sections as a whole.
OPAQUE_SECTIONS = frozenset(
    {
        "pipeline",
        "autotuning",
        "elasticity",
        "compression_training",
        "data_efficiency",
        "curriculum_learning",
        "sparse_attention",
        "tensor_parallel",
        "weight_quantization",
        "quantize_training",
        "compile",
        "aio",
    }
)


@dataclass
class AutoResult:
    batch_auto: set[str] = field(default_factory=set)
    """Batch keys that were "auto" (removed from the config; batch.py infers them)."""
    problems: list[str] = field(default_factory=list)


def resolve_auto(config: dict[str, Any]) -> AutoResult:
    """Edit `config` in place: drop batch "auto"s, fill zero defaults, remove (and refuse) the rest."""
    result = AutoResult()
    for key in BATCH_KEYS:
        if config.get(key) == AUTO:
            del config[key]
            result.batch_auto.add(key)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _fill_defaults(zero, ZERO_AUTO_DEFAULTS, "zero_optimization")
        offload_param = zero.get("offload_param")
        if isinstance(offload_param, dict):
            _fill_defaults(offload_param, OFFLOAD_PARAM_AUTO_DEFAULTS, "zero_optimization.offload_param")
    for path in _auto_leaves(config, ()):
        result.problems.append(
            f'{dotted(path)}: "auto" can only be filled in by the Hugging Face Trainer; write {_what_to_write(path)}'
        )
        _remove(config, path)
    return result


def _fill_defaults(section: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    for key, default in defaults.items():
        if section.get(key) == AUTO:
            section[key] = default
            if key == "stage3_arena_bytes":  # ours, not DeepSpeed's: the engine sizes it from the model
                logger.info('%s.%s: "auto" -> sized from the model at initialize', prefix, key)
            else:
                logger.info('%s.%s: "auto" -> DeepSpeed default %s', prefix, key, default)


def _auto_leaves(node: Any, path: tuple[str | int, ...]) -> list[tuple[str | int, ...]]:
    if isinstance(node, str) and node == AUTO:
        return [path]
    if isinstance(node, dict):
        children = [(k, v) for k, v in node.items() if not (not path and k in OPAQUE_SECTIONS)]
    elif isinstance(node, list):
        children = list(enumerate(node))
    else:
        return []
    found: list[tuple[str | int, ...]] = []
    for key, value in children:
        found.extend(_auto_leaves(value, (*path, key)))
    return found


def _what_to_write(path: tuple[str | int, ...]) -> str:
    last = path[-1] if path else ""
    if last == "enabled":
        return "true or false"
    if last == "betas":
        return "a list of two numbers, e.g. [0.9, 0.999]"
    if last in ("opt_level",):
        return "the value you want"
    return "a number"


def _remove(config: dict[str, Any], path: tuple[str | int, ...]) -> None:
    """Drop a refused "auto" (a whole list if it sits inside one) so later checks see only real values."""
    cut = next((i for i, part in enumerate(path) if isinstance(part, int)), len(path))
    parent: Any = config
    for part in path[: cut - 1]:
        parent = parent[part]
    parent.pop(path[cut - 1], None)
