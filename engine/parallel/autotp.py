"""AutoTP for training (DeepSpeed's `tp_model_init`): shard an ordinary torch model's Linear layers
across the tensor-parallel group by their names, without the user rewriting the model.

    model = engine.tp_model_init(model, tp_size=2)   # in place; every rank, same seed, same model

plan_autotp() is the pure part: it names a kind for every module that holds parameters, by the first
rule whose regex matches the module's qualified name (the user's `rules` first, then RULES):

    column             ColumnParallelLinear, output left split: this rank's rows (its heads, its slice
                       of the MLP's hidden units)
    column_fused_qkv   one Linear holding [q; k; v] stacked along out_features: each third split by
                       rows, so this rank keeps [q_r; k_r; v_r], its heads' q, k and v
    row                RowParallelLinear taking that split input; the partial products are summed
                       (all-reduce) and the bias is added once
    replicate          left whole on every rank (embeddings, norms, heads, anything unmatched)

A column layer and the row layer after it are Megatron's pair (layers.py's docstring): the activation
between them stays split, so attention must reshape by head_dim, not by a head count fixed at build
time (`view(b, t, -1, head_dim)`, as Hugging Face models do; examples/gpt.py does the same).

Only torch.nn.Linear itself is sharded. A module of another type that matches a sharding rule and holds
a weight matrix (transformers' Conv1D in GPT-2, a Linear subclass) is refused by name rather than left
whole, which would silently not shard what the rule promised.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn

from engine import comm
from engine.config.autotp_specs import AutoTPSpecs
from engine.config.errors import ConfigError
from engine.config.tp_model_init import tp_model_init_config
from engine.parallel.groups import groups, initialize_model_parallel, model_parallel_is_initialized
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger("engine")

Kind = Literal["column", "column_fused_qkv", "row", "replicate"]
KINDS: tuple[str, ...] = get_args(Kind)
SHARDED: frozenset[str] = frozenset({"column", "column_fused_qkv", "row"})

_END = r"(^|\.)"  # a rule names the last component(s) of a qualified module name

RULES: tuple[tuple[str, Kind], ...] = (
    # Output heads, classifiers, poolers and MoE routers stay whole: a vocabulary-split head would need
    # a vocabulary-parallel loss that the model's own forward does not compute.
    (_END + r"(lm_head|head|embed_out|score|classifier|pooler\.dense|gate|router)$", "replicate"),
    # [q; k; v] stacked in one Linear (GPT-2's c_attn, MPT's Wqkv, Phi-3's qkv_proj, Baichuan's W_pack).
    (_END + r"(qkv|qkv_proj|c_attn|Wqkv|W_pack)$", "column_fused_qkv"),
    # query_key_value (GPT-NeoX, Bloom, Megatron) interleaves q, k, v per head: a plain row split
    # already gives each rank whole heads; splitting it as three stacked parts would mix heads.
    (_END + r"query_key_value$", "column"),
    # Attention inputs; MLP up / gate (BERT's intermediate.dense; the first Linear of an MLP Sequential).
    (_END + r"(q_proj|k_proj|v_proj|query|key|value|wq|wk|wv)$", "column"),
    (_END + r"(up_proj|gate_proj|fc1|fc_in|c_fc|w1|w3|dense_h_to_4h|intermediate\.dense)$", "column"),
    (_END + r"(mlp|ffn|feed_forward)\.0$", "column"),
    # Attention out; MLP down (and the later Linear of an MLP Sequential).
    (_END + r"(o_proj|out_proj|proj|c_proj|dense|wo)$", "row"),
    (_END + r"(down_proj|fc2|fc_out|w2|dense_4h_to_h)$", "row"),
    (_END + r"(mlp|ffn|feed_forward)\.\d+$", "row"),
)
"""The default rules, tried in order after the user's; the first match decides. Unmatched: replicate."""

HEAD_COUNTS = (
    "n_heads",
    "n_head",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "num_kv_heads",
)
"""Int attributes (on any module, or on model.config) that count attention heads: each must divide by
tp_size, or some rank's shard would hold part of a head."""


# ------------------------------------------------------------------ the plan (pure)
def plan_autotp(
    model: nn.Module, tp_size: int, rules: Mapping[str, str] | None = None, *, specs: AutoTPSpecs | None = None
) -> list[tuple[str, Kind]]:
    """(qualified module name, kind) for every module that holds parameters itself, in model order.
    The user's `rules` decide first; then DeepSpeed's layer specs from the config (`specs`:
    tensor_parallel.partition_config / preset_model, engine/config/autotp_specs.py) when given, else
    RULES. Refuses, with one ConfigError listing every problem: an unknown kind or a bad regex in
    `rules`, a user rule that matches nothing, a sharded dimension or a head count not divisible by
    tp_size, a module of a type it cannot shard matching a sharding rule, a sharded weight tied to
    another module, a Linear no spec matches under strict_mode, and (tp_size > 1) a plan with nothing
    sharded or with column layers but no row layer."""
    return _plan(model, tp_size, rules, specs)[0]


def _plan(
    model: nn.Module, tp_size: int, rules: Mapping[str, str] | None, specs: AutoTPSpecs | None
) -> tuple[list[tuple[str, Kind]], dict[str, int]]:
    """plan_autotp's plan, and the parts of every column layer holding several stacked along
    out_features (3 for column_fused_qkv; a layer spec's `shape: [N, -1]`)."""
    _check_tp_size(tp_size)
    user = _compiled_rules(rules)
    table = [*user, *((re.compile(p), k) for p, k in RULES)] if specs is None else user
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    owners = _param_owners(model)
    plan: list[tuple[str, Kind]] = []
    parts: dict[str, int] = {}
    problems: list[str] = []
    foreign: dict[type, list[str]] = {}  # type -> "name (kind)" of modules it cannot shard that match a rule
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        kind: Kind | None = next((k for pattern, k in table if pattern.search(name)), None)
        count = 3 if kind == "column_fused_qkv" else 1
        if kind is None and specs is not None:
            spec = specs.first(name, model_type)
            if spec is not None:
                kind, count = spec.kind, spec.parts
            elif specs.strict and isinstance(module, nn.Linear):
                problems.append(
                    f"{name}: no layer spec matches {name}.weight and tensor_parallel.partition_config.strict_mode "
                    "is true; add a layer spec for it (partition_type skip keeps it whole)"
                )
        kind = kind or "replicate"
        if kind in SHARDED and type(module) is nn.Linear:
            problem = _check_linear(name, module, kind, count, tp_size, owners)
            if problem:
                problems.append(problem)
            elif count > 1:
                parts[name] = count
        elif kind in SHARDED:
            if any(p.dim() == 2 for p in module.parameters(recurse=False)):  # a Linear in another form
                foreign.setdefault(type(module), []).append(f"{name} ({kind})")
            kind = "replicate"  # no weight matrix (a norm, a convolution): nothing to shard, keep it whole
        plan.append((name, kind))
    problems += [_cannot_shard(cls, names) for cls, names in foreign.items()]
    problems += [
        f"rules: {p.pattern!r} matches no module that holds parameters; check the name against "
        f"model.named_modules() (e.g. {_examples(plan)})"
        for p, _ in user
        if not any(p.search(name) for name, _ in plan)
    ]
    if tp_size > 1:
        problems += _check_heads(model, tp_size) + _check_fused_heads(model, plan)
    if tp_size > 1 and not problems:  # (a refused module would also read as a missing one here)
        problems += _check_pairs(plan, tp_size)
    if problems:
        raise ConfigError(problems)
    return plan, parts


def _check_tp_size(tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size={tp_size!r} must be an int >= 1 (1: no tensor parallelism)")


def _compiled_rules(rules: Mapping[str, str] | None) -> list[tuple[re.Pattern[str], Kind]]:
    compiled: list[tuple[re.Pattern[str], Kind]] = []
    problems: list[str] = []
    for pattern, kind in (rules or {}).items():
        if kind not in KINDS:
            problems.append(f"rules: {pattern!r} -> {kind!r} is not a kind AutoTP knows; use one of {', '.join(KINDS)}")
            continue
        try:
            compiled.append((re.compile(pattern), kind))  # type: ignore[arg-type]  # checked against KINDS
        except re.error as e:
            problems.append(f"rules: {pattern!r} is not a valid regular expression ({e})")
    if problems:
        raise ConfigError(problems)
    return compiled


def _param_owners(model: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> ids of the modules holding it directly (more than one: tied weights)."""
    owners: dict[int, set[int]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    return owners


def _cannot_shard(cls: type, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{shown}: {cls.__module__}.{cls.__qualname__} matches sharding rules but AutoTP shards only "
        "torch.nn.Linear itself; convert these layers to nn.Linear (transformers' Conv1D holds the transposed "
        f"weight: Linear.weight = Conv1D.weight.T), or keep them whole with rules={{{_exact(names[0].split()[0])!r}"
        ": 'replicate', ...}"
    )


def _check_linear(
    name: str, module: nn.Linear, kind: Kind, parts: int, tp_size: int, owners: dict[int, set[int]]
) -> str:
    """'' when `module` can be sharded as `kind`, else the problem in words."""
    tied = [p for p in module.parameters(recurse=False) if owners[id(p)] != {id(module)}]
    if tied:
        return (
            f"{name} shares its weight with another module (tied weights); sharding it would untie them: "
            f"pass rules={{{_exact(name)!r}: 'replicate'}}"
        )
    fix = f"use a tp_size that divides it, or pass rules={{{_exact(name)!r}: 'replicate'}}"
    if kind == "row":
        if module.in_features % tp_size:
            return f"{name}: in_features {module.in_features} is not divisible by tp_size {tp_size} (row); {fix}"
    elif kind == "column" and parts == 1:
        if module.out_features % tp_size:
            return f"{name}: out_features {module.out_features} is not divisible by tp_size {tp_size} (column); {fix}"
    elif kind == "column":
        if module.out_features % parts or (module.out_features // parts) % tp_size:
            return (
                f"{name}: out_features {module.out_features} is not {parts} equal parts each divisible by tp_size "
                f"{tp_size} (its layer spec's shape [{parts}, -1]); {fix}"
            )
    elif module.out_features % 3 or (module.out_features // 3) % tp_size:
        return (
            f"{name}: out_features {module.out_features} is not 3 parts (q, k, v) each divisible by tp_size "
            f"{tp_size} (column_fused_qkv); {fix}"
        )
    return ""


def _head_counts(model: nn.Module) -> list[tuple[str, str, int]]:
    """(where, attribute, value) of every head count on the modules and on model.config."""
    found: list[tuple[str, str, int]] = []
    holders: list[tuple[str, object]] = [(n or "model", m) for n, m in model.named_modules()]
    if getattr(model, "config", None) is not None:
        holders.append(("model.config", model.config))
    for where, holder in holders:
        for attr in HEAD_COUNTS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((where, attr, value))
    return found


def _check_heads(model: nn.Module, tp_size: int) -> list[str]:
    seen: dict[tuple[str, int], list[str]] = {}  # one message per (attribute, value), not one per layer
    for where, attr, value in _head_counts(model):
        if value % tp_size:
            seen.setdefault((attr, value), []).append(f"{where}.{attr}")
    return [
        f"{at[0]}{f' (and {len(at) - 1} more)' if len(at) > 1 else ''} = {value} attention heads is not "
        f"divisible by tp_size {tp_size}: a rank would hold part of a head; use a tp_size that divides {value}"
        for (_, value), at in seen.items()
    ]


def _check_fused_heads(model: nn.Module, plan: list[tuple[str, Kind]]) -> list[str]:
    """A fused qkv with fewer key/value heads than query heads is not three equal parts."""
    fused = [name for name, kind in plan if kind == "column_fused_qkv"]
    counts = {attr: value for _, attr, value in _head_counts(model)}
    kv = counts.get("num_key_value_heads", counts.get("n_kv_heads", counts.get("num_kv_heads")))
    heads = counts.get("num_attention_heads", counts.get("n_heads", counts.get("n_head", counts.get("num_heads"))))
    if not fused or kv is None or heads is None or kv == heads:
        return []
    return [
        f"{name}: a fused qkv with {heads} query heads and {kv} key/value heads is not three equal parts, "
        f"which column_fused_qkv needs; pass rules={{{_exact(name)!r}: 'replicate'}} (or split the layer into "
        "q_proj, k_proj, v_proj)"
        for name in fused
    ]


def _check_pairs(plan: list[tuple[str, Kind]], tp_size: int) -> list[str]:
    columns = [n for n, k in plan if k in ("column", "column_fused_qkv")]
    rows = [n for n, k in plan if k == "row"]
    if not columns and not rows:
        nothing = (
            f"no module matches a sharding rule, so tp_size {tp_size} would shard nothing (modules: "
            f"{_examples(plan)}); pass rules={{regex: 'column' | 'column_fused_qkv' | 'row'}} naming the "
            "model's attention and MLP Linears, or use tp_size 1"
        )
        return [nothing]
    if not columns or not rows:
        have, lack = ("column", "row") if columns else ("row", "column")
        unpaired = (
            f"the plan has {have} layers ({', '.join((columns or rows)[:3])}) but no {lack} layer: a "
            "column layer's split output must feed a row layer; add the missing rule with rules="
        )
        return [unpaired]
    return []


def _exact(name: str) -> str:
    return "^" + re.escape(name) + "$"


def _examples(plan: list[tuple[str, Kind]]) -> str:
    names = [n for n, _ in plan]
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") if names else "none"


# ------------------------------------------------------------------ sharding
def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    config: Any = None,
    *,
    rules: Mapping[str, str] | None = None,
) -> nn.Module:
    """Shard `model` in place for tensor parallelism of `tp_size` by plan_autotp(model, tp_size, rules,
    specs=the config's layer specs), and return it marked `ds_autotp_parsed` (DeepSpeed's name;
    `ds_autotp_size` records the size).

    Every rank calls it with the same model (built from the same seed): each keeps its own slice.
    Makes the tensor-parallel groups (engine.parallel.initialize_model_parallel(tp_size)) unless they
    exist; if they exist with another size, refuses. `dtype` casts the model; `config` (a DeepSpeed
    config dict or path, or an EngineConfig) must agree with tp_size and dtype. Calling it again with
    the same tp_size does nothing; tp_size 1 shards nothing."""
    _check_tp_size(tp_size)
    if getattr(model, "ds_autotp_parsed", False):
        done = getattr(model, "ds_autotp_size", None)
        if done != tp_size:
            raise ConfigError(
                f"tp_model_init: the model is already sharded for tp_size {done}; it cannot be "
                f"resharded for tp_size {tp_size}: build the model again, or pass tp_size {done}"
            )
        if config is not None and tp_size > 1:
            _check_same_specs(getattr(model, "ds_autotp_specs", None), _check_config(config, tp_size, dtype))
        return model
    specs = _check_config(config, tp_size, dtype)
    if model_parallel_is_initialized() and groups().tp_size != tp_size:
        raise ConfigError(
            f"tp_model_init(tp_size={tp_size}) but the tensor-parallel groups already have size "
            f"{groups().tp_size} (engine.parallel.initialize_model_parallel); pass tp_size "
            f"{groups().tp_size}, or call engine.parallel.destroy_model_parallel() first"
        )
    plan, parts = _plan(model, tp_size, rules, specs) if tp_size > 1 else ([], {})
    made = initialize_model_parallel(tp_size)
    _shard(model, plan, parts, made.tp_group)
    if dtype is not None:
        model.to(dtype)
    # Plain attributes (nn.Module.__setattr__ is typed for tensors and modules only).
    object.__setattr__(model, "ds_autotp_parsed", True)
    object.__setattr__(model, "ds_autotp_size", tp_size)
    object.__setattr__(model, "ds_autotp_specs", specs)
    if plan and comm.get_rank() == 0:
        counts = {k: sum(1 for _, kind in plan if kind == k) for k in KINDS}
        logger.info("AutoTP tp_size %d: %s", tp_size, ", ".join(f"{n} {k}" for k, n in counts.items()))
    return model


def _check_same_specs(sharded_by: AutoTPSpecs | None, config_says: AutoTPSpecs | None) -> None:
    """A model sharded earlier (engine.tp_model_init without the config) must have been planned by the
    layer specs the config now gives (engine.initialize calls again with it): else the split the
    config asks for is silently not the one trained."""
    if sharded_by == config_says:
        return
    how = "the engine's name rules" if sharded_by is None else "other layer specs"
    wants = (
        "the engine's name rules (no tensor_parallel.partition_config or preset_model)"
        if config_says is None
        else "its tensor_parallel.partition_config / preset_model layer specs"
    )
    raise ConfigError(
        f"the model was already sharded by engine.tp_model_init with {how}, but the config asks for {wants}; "
        "pass the same config to engine.tp_model_init(model, tp_size, config=...), or let engine.initialize "
        "shard the model"
    )


def _shard(model: nn.Module, plan: list[tuple[str, Kind]], parts: Mapping[str, int], group: Any) -> None:
    """Replace every sharded module by its parallel layer, in every parent holding it (a module can be
    shared); the dense module is dropped, so its full weight is freed once nothing else holds it."""
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            parents.setdefault(id(child), []).append((parent, attr))
    for name, kind in plan:
        if kind not in SHARDED:
            continue
        dense = model.get_submodule(name)
        assert isinstance(dense, nn.Linear)
        layer: nn.Module
        if kind == "row":
            layer = RowParallelLinear.from_dense(dense, input_is_parallel=True, group=group)
        else:
            layer = ColumnParallelLinear.from_dense(dense, gather_output=False, group=group, parts=parts.get(name, 1))
        for parent, attr in parents[id(dense)]:
            setattr(parent, attr, layer)


def _check_config(config: Any, tp_size: int, dtype: torch.dtype | None) -> AutoTPSpecs | None:
    """The config's layer specs (None: none, the engine's RULES apply); its tensor_parallel sizes and
    precision must agree with the arguments (DeepSpeed refuses the same conflicts)."""
    if config is None:
        return None
    read = tp_model_init_config(config)
    wants = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[read.precision]
    for key, size in read.sizes.items():
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int):
            raise ConfigError(f"the config's {key} is {size!r}; write an int (0 or 1: off)")
        if max(size, 1) != tp_size:
            raise ConfigError(f"tp_model_init(tp_size={tp_size}) but the config's {key} is {size}; make them equal")
    if dtype is not None and wants is not None and dtype != wants:
        raise ConfigError(
            f"tp_model_init(dtype={dtype}) but the config trains in {wants}; pass dtype={wants} or "
            "change the config's bf16/fp16 section"
        )
    return read.specs
