"""DeepSpeed's configurable AutoTP, read into the engine's AutoTP plan: `tensor_parallel.partition_config`
(layer specs a user writes for a model) and `tensor_parallel.preset_model` (DeepSpeed's specs for common
model families).

A layer spec names parameters by regex (matched from the start of `<module name>.weight`, as DeepSpeed
does) and says how their Linear is split:

    "row"       RowParallelLinear (partition_dim 1, the default)
    "column"    ColumnParallelLinear (partition_dim 0, the default); `shape: [N, -1]` declares N equal
                parts stacked along out_features (a fused [q; k; v], [gate; up]): each part is split and
                this rank keeps its share of every part (the engine's partition_stride)
    "skip"      left whole on every rank

With specs, only what they match is sharded (DeepSpeed: "rely only on explicit specs"); the engine's own
name rules (engine/parallel/autotp.py's RULES) apply when the config has neither key. A preset with a
partition_config whose use_default_specs is true (DeepSpeed's default) tries the partition_config's specs
first, then the preset's. What DeepSpeed's specs can say and the engine cannot do (unequal parts, a
gathered column output, gradient all-reduce of a skipped layer, other reshapes) is refused here, at
config load, by key path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.config.errors import ConfigError

SpecKind = Literal["column", "row", "replicate"]

_KIND_OF_TYPE: dict[str, SpecKind] = {"column": "column", "row": "row", "skip": "replicate"}
_DEFAULT_DIM = {"column": 0, "row": 1}


@dataclass(frozen=True)
class LayerSpec:
    """One layer spec: which Linears (by weight name), how they are split, and where it was written."""

    patterns: tuple[re.Pattern[str], ...]
    kind: SpecKind
    parts: int
    """Equal parts stacked along out_features (a column layer's `shape: [N, -1]`); 1: one part."""
    where: str
    """Its config key path (or the preset's name), for messages."""
    model_types: tuple[str, ...] = ()
    """Hugging Face model types it is limited to (lower case); empty: any model."""

    def matches(self, module_name: str, model_type: str | None) -> bool:
        if self.model_types and (model_type or "").lower() not in self.model_types:
            return False
        weight = module_name + ".weight"
        return any(p.match(weight) for p in self.patterns)


@dataclass(frozen=True)
class AutoTPSpecs:
    """The layer specs in the order they are tried (the first match decides), and strict_mode: every
    nn.Linear must match one."""

    specs: tuple[LayerSpec, ...]
    strict: bool = False

    def first(self, module_name: str, model_type: str | None) -> LayerSpec | None:
        return next((s for s in self.specs if s.matches(module_name, model_type)), None)


# DeepSpeed's presets (tensor_parallel.preset_model), as (patterns, type, parts) rows.
_ATTN_O, _MLP_DOWN = r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"
_LLAMA: tuple[tuple[tuple[str, ...], str, int], ...] = (
    ((_ATTN_O,), "row", 1),
    ((r".*\.self_attn\.[qkv]_proj\.weight$",), "column", 1),
    ((_MLP_DOWN,), "row", 1),
    ((r".*\.mlp\.(up|gate)_proj\.weight$",), "column", 1),
)
PRESETS: dict[str, tuple[tuple[tuple[str, ...], str, int], ...]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "bloom": (
        ((r".*\.self_attention\.dense\.weight$",), "row", 1),
        ((r".*\.self_attention\.query_key_value\.weight$",), "column", 1),  # heads interleaved: a plain split
        ((r".*\.mlp\.dense_4h_to_h\.weight$",), "row", 1),
        ((r".*\.mlp\.dense_h_to_4h\.weight$",), "column", 1),
    ),
    "chatglm": (
        ((r".*\.self_attention\.dense\.weight$",), "row", 1),
        ((r".*\.self_attention\.query_key_value\.weight$",), "column", 3),
        ((r".*\.mlp\.dense_4h_to_h\.weight$",), "row", 1),
        ((r".*\.mlp\.dense_h_to_4h\.weight$",), "column", 2),
    ),
    "phi3": (
        ((_ATTN_O,), "row", 1),
        ((r".*\.self_attn\.qkv_proj\.weight$",), "column", 3),
        ((_MLP_DOWN,), "row", 1),
        ((r".*\.mlp\.gate_up_proj\.weight$",), "column", 2),
    ),
    "mixtral": (
        ((_ATTN_O,), "row", 1),
        ((r".*\.self_attn\.[qkv]_proj\.weight$",), "column", 1),
        ((r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$",), "row", 1),
        ((r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$",), "column", 1),
        ((r".*\.block_sparse_moe\.gate\.weight$",), "skip", 1),
    ),
    "deepseek_v2": (
        ((_ATTN_O,), "row", 1),
        ((r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$",), "skip", 1),
        ((r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$",), "column", 1),
        ((r".*\.mlp\.experts\.\d+\.down_proj\.weight$",), "row", 1),
        ((r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$",), "column", 1),
        ((r".*\.mlp\.gate\.weight$",), "skip", 1),
        ((r".*\.mlp\.shared_experts\.down_proj\.weight$",), "row", 1),
        ((r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$",), "column", 1),
    ),
}

_ROOT = "tensor_parallel.partition_config"
# partition_config keys that only steer DeepSpeed's vocabulary-parallel head and embedding split, which
# the engine does not do: accepted at DeepSpeed's defaults, refused otherwise.
_DEFAULTS_ONLY = {"embedding_partition_dim": 1, "lm_head_patterns": ["lm_head", "embed_out"]}


def read_specs(section: Mapping[str, Any] | None) -> AutoTPSpecs | None:
    """The layer specs of a `tensor_parallel` section, or None when it has neither partition_config
    nor preset_model (the engine's own rules then apply). Refuses what the engine cannot do, naming
    every problem by key path."""
    section = section or {}
    custom, preset = section.get("partition_config"), section.get("preset_model")
    if custom is None and preset is None:
        return None
    problems: list[str] = []
    base: list[LayerSpec] = []
    if preset is not None:
        rows = PRESETS.get(str(preset).lower())
        if rows is None:
            problems.append(
                f"tensor_parallel.preset_model: {preset!r} is not a DeepSpeed preset; the presets: "
                f"{', '.join(PRESETS)} (or write tensor_parallel.partition_config.layer_specs)"
            )
        else:
            where = f"tensor_parallel.preset_model {str(preset).lower()!r}"
            base = [LayerSpec(tuple(re.compile(p) for p in pats), _KIND_OF_TYPE[t], n, where) for pats, t, n in rows]
    own: list[LayerSpec] = []
    strict = False
    if custom is not None:
        own, strict = _read_partition_config(custom, problems)
    if problems:
        raise ConfigError(problems)
    if custom is None:
        return AutoTPSpecs(tuple(base))
    use_default = custom.get("use_default_specs", True) is not False
    return AutoTPSpecs(tuple(own + (base if use_default else [])), strict)


def _read_partition_config(custom: Mapping[str, Any], problems: list[str]) -> tuple[list[LayerSpec], bool]:
    for key, default in _DEFAULTS_ONLY.items():
        if key in custom and custom[key] != default:
            problems.append(
                f"{_ROOT}.{key}: {custom[key]!r} steers DeepSpeed's vocabulary-parallel embedding and head, which "
                f"this engine does not split (they stay whole on every rank); remove it or write {default!r}"
            )
    specs: list[LayerSpec] = []
    for i, raw in enumerate(custom.get("layer_specs") or []):
        spec = _read_spec(raw, f"{_ROOT}.layer_specs[{i}]", problems)
        if spec is not None:
            specs.append(spec)
    return specs, custom.get("strict_mode") is True


def _read_spec(raw: Mapping[str, Any], where: str, problems: list[str]) -> LayerSpec | None:
    before = len(problems)
    kind_name = str(raw.get("partition_type", "column")).lower()
    kind = _KIND_OF_TYPE.get(kind_name)
    if kind is None:
        problems.append(f"{where}.partition_type: {raw.get('partition_type')!r} is not column, row or skip")
        return None
    patterns: list[re.Pattern[str]] = []
    for k, text in enumerate(raw.get("patterns") or []):
        try:
            patterns.append(re.compile(text))
        except re.error as e:
            problems.append(f"{where}.patterns[{k}]: {text!r} is not a valid regular expression ({e})")
    if not raw.get("patterns"):
        problems.append(f"{where}.patterns: a layer spec needs at least one regex of parameter names")
    if raw.get("gather_output") is True:
        problems.append(
            f"{where}.gather_output: a column layer whose output is gathered on every rank is not implemented; "
            "pair the column layer with a row layer, or mark it skip"
        )
    if raw.get("grad_allreduce") is True:
        problems.append(
            f"{where}.grad_allreduce: summing a replicated layer's gradients over the tensor-parallel group is "
            "not implemented; remove it (the engine's replicated layers see the whole input on every rank)"
        )
    dim = raw.get("partition_dim")
    if kind in _DEFAULT_DIM and dim is not None and dim != _DEFAULT_DIM[kind_name]:
        problems.append(
            f"{where}.partition_dim: {dim} on a {kind_name} layer; this engine splits a column layer's weight "
            "along dim 0 (out_features) and a row layer's along dim 1 (in_features)"
        )
    parts = _parts(raw.get("shape"), kind_name, where, problems)
    models = tuple(str(m).lower() for m in raw.get("model_types") or ())
    if len(problems) > before:
        return None
    return LayerSpec(tuple(patterns), kind, parts, where, models)


def _parts(shape: Sequence[Any] | None, kind_name: str, where: str, problems: list[str]) -> int:
    """N of a column layer's `shape: [N, -1]` (N equal parts); 1 without a shape."""
    if shape is None:
        return 1
    first = shape[0] if len(shape) == 2 and shape[1] == -1 else None
    if kind_name == "column" and isinstance(first, int) and not isinstance(first, bool) and first >= 1:
        return first
    if kind_name == "column" and isinstance(first, (list, tuple)):
        problems.append(
            f"{where}.shape: {list(shape)!r} declares parts of unequal sizes (e.g. a [q; k; v] with fewer key/value "
            "heads than query heads); this engine splits a fused layer of equal parts only: split the Linear "
            "into one per part, or mark it skip"
        )
        return 1
    problems.append(
        f"{where}.shape: {list(shape)!r} on a {kind_name} layer; this engine reads [N, -1] on a column layer "
        "(N equal parts stacked along out_features) and no shape otherwise"
    )
    return 1
