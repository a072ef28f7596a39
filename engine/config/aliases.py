"""Map DeepSpeed's deprecated and alternative spellings onto one canonical form.

Later checks (auto, batch, support table, dataclasses) read canonical names only. `origins` remembers
what the user wrote so a refusal of `zero_optimization.offload_optimizer.device` can say it came from
`zero_optimization.cpu_offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# DeepSpeed's pydantic model accepts both the field name and its "stage3_" alias; ZeroConfig uses the
# stage3_ names, so those are canonical here.
ZERO_STAGE3_ALIASES: dict[str, str] = {
    name: "stage3_" + name
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
        "partition_stream_chunk_size",
    )
}
ZERO_STAGE3_ALIASES["stage3_gather_fp16_weights_on_model_save"] = "stage3_gather_16bit_weights_on_model_save"

TOP_LEVEL_ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    # DeepSpeed's docs spell it out; its code reads seq_parallel_comm_data_type.
    "seq_parallel_communication_data_type": "seq_parallel_comm_data_type",
}


@dataclass
class Normalized:
    config: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)
    """canonical dotted path -> what the user wrote, for keys that were renamed or derived."""
    deprecations: list[tuple[str, str]] = field(default_factory=list)
    """(key, message) pairs to warn about once the config loads."""
    problems: list[str] = field(default_factory=list)


def normalize(config: dict[str, Any]) -> Normalized:
    out = Normalized(config)
    _rename(config, TOP_LEVEL_ALIASES, "", out)
    _legacy_zero_flag(config, out)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _rename(zero, ZERO_STAGE3_ALIASES, "zero_optimization.", out)
        _cpu_offload(zero, "cpu_offload", "offload_optimizer", out)
        _cpu_offload(zero, "cpu_offload_param", "offload_param", out)
        if zero.pop("cpu_offload_use_pin_memory", None) is not None:
            message = (
                "zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect; use "
                "offload_optimizer.pin_memory / offload_param.pin_memory"
            )
            out.deprecations.append(("zero_optimization.cpu_offload_use_pin_memory", message))
        if zero.get("overlap_comm") is None:
            # DeepSpeed: null means "on for stage 3, off otherwise".
            zero["overlap_comm"] = zero.get("stage", 0) == 3
    return out


def _rename(section: dict[str, Any], aliases: dict[str, str], prefix: str, out: Normalized) -> None:
    for old, new in aliases.items():
        if old not in section:
            continue
        if new in section:
            out.problems.append(
                f"{prefix}{old}: given together with {prefix}{new}, which it is another "
                f"name for; keep only {prefix}{new}"
            )
            section.pop(old)
            continue
        section[new] = section.pop(old)
        out.origins[prefix + new] = prefix + old
        if not new.endswith(old):  # prefix-less stage3 names are a documented spelling, not deprecated
            out.deprecations.append((prefix + old, f"{prefix}{old} is read as {prefix}{new}; write {prefix}{new}"))


def _legacy_zero_flag(config: dict[str, Any], out: Normalized) -> None:
    flag = config.get("zero_optimization")
    legacy_size = config.pop("allgather_size", None)
    if isinstance(flag, bool):
        section: dict[str, Any] = {"stage": 1 if flag else 0}
        if flag and legacy_size is not None:
            section["allgather_bucket_size"] = legacy_size
        config["zero_optimization"] = section
        out.origins["zero_optimization.stage"] = f"zero_optimization: {str(flag).lower()}"
        message = 'the boolean form of "zero_optimization" is deprecated; write "zero_optimization": {"stage": N}'
        out.deprecations.append(("zero_optimization", message))
    elif legacy_size is not None:
        message = (
            'allgather_size is only read with the legacy "zero_optimization": true; use '
            "zero_optimization.allgather_bucket_size"
        )
        out.deprecations.append(("allgather_size", message))


def _cpu_offload(zero: dict[str, Any], old: str, new: str, out: Normalized) -> None:
    if old not in zero:
        return
    value = zero.pop(old)
    out.deprecations.append(
        (
            f"zero_optimization.{old}",
            f'zero_optimization.{old} is deprecated; use zero_optimization.{new}.device "cpu"',
        )
    )
    if not value:
        return
    if zero.get(new) is not None:
        out.problems.append(
            f"zero_optimization.{old}: given together with zero_optimization.{new}, which "
            f"replaces it; keep only zero_optimization.{new}"
        )
        return
    zero[new] = {"device": "cpu"}
    out.origins[f"zero_optimization.{new}.device"] = f"zero_optimization.{old}: true"
