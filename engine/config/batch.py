"""Batch-size arithmetic, following DeepSpeed's rules exactly.

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size

All three given: checked. Two given: the third is inferred. train only: gas 1, micro = train / ws.
micro only: gas 1. Neither train nor micro: error. Where DeepSpeed floors a division and then fails
its assertion with bare numbers, we say which division does not come out even, show the arithmetic and
where the world size came from (users' top complaint: numbers without the reason).
"""

from __future__ import annotations

from dataclasses import dataclass

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    train: int
    micro: int
    gas: int


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, *, world_size: int, world_size_source: str
) -> tuple[BatchSizes | None, list[str], list[str]]:
    """(sizes or None, problems, notes on what was inferred)."""
    ws = world_size
    origin = f"world size {ws} detected from {world_size_source}"
    if train is not None and micro is not None and gas is not None:
        product = micro * gas * ws
        if train != product:
            message = (
                f"{TRAIN} ({train}) != {MICRO} ({micro}) x {GAS} ({gas}) x world size ({ws}) = "
                f"{product}; {origin}; fix: set {TRAIN} to {product}, or remove one of the three "
                "keys so it is inferred from the other two"
            )
            return None, [message], []
        return BatchSizes(train, micro, gas), [], []
    if train is not None and micro is not None:
        inferred = _divide(train, micro * ws, f"{MICRO} ({micro}) x world size ({ws})", GAS, origin)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, micro, inferred), [], [_note(GAS, inferred, f"{train} / ({micro} x {ws})")]
    if train is not None and gas is not None:
        inferred = _divide(train, gas * ws, f"{GAS} ({gas}) x world size ({ws})", MICRO, origin)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, inferred, gas), [], [_note(MICRO, inferred, f"{train} / ({gas} x {ws})")]
    if micro is not None and gas is not None:
        total = micro * gas * ws
        return BatchSizes(total, micro, gas), [], [_note(TRAIN, total, f"{micro} x {gas} x {ws}")]
    if train is not None:
        inferred = _divide(train, ws, f"world size ({ws})", MICRO, origin, gas_default=True)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, inferred, 1), [], [_note(MICRO, inferred, f"{train} / {ws} with {GAS} 1")]
    if micro is not None:
        return BatchSizes(micro * ws, micro, 1), [], [_note(TRAIN, micro * ws, f"{micro} x 1 x {ws}")]
    only_gas = f" ({GAS} alone is not enough)" if gas is not None else ""
    message = (
        f"neither {TRAIN} nor {MICRO} is set{only_gas}; fix: set {MICRO} (samples per rank per "
        f"micro-step) and optionally {GAS}; {TRAIN} is then {MICRO} x {GAS} x world size"
    )
    return None, [message], []


def _divide(
    total: int, divisor: int, divisor_text: str, target: str, origin: str, gas_default: bool = False
) -> int | str:
    """total / divisor when it is a positive whole number, else the problem message."""
    if total % divisor == 0 and total >= divisor:
        return total // divisor
    lower = max(divisor, total - total % divisor)
    upper = lower + divisor if total >= divisor else divisor
    candidates = f"{lower}" if lower == upper else f"{lower} or {upper}"
    assumed = f" ({GAS} defaults to 1 when only {TRAIN} is given)" if gas_default else ""
    return (
        f"{TRAIN} ({total}) is not a positive multiple of {divisor_text} = {divisor}, so {target} "
        f"cannot be inferred{assumed}; {origin}; fix: make {TRAIN} a multiple of {divisor} "
        f"(e.g. {candidates}), or change the other batch keys so it divides evenly"
    )


def _note(key: str, value: int, arithmetic: str) -> str:
    return f"{key} inferred as {value} = {arithmetic}"
