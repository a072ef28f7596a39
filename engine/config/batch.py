"""Batch-size arithmetic, following DeepSpeed's rules exactly.

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size

All three given: checked. Two given: the third is inferred. train only: gas 1, micro = train / ws.
micro only: gas 1. Neither train nor micro: error. Where DeepSpeed floors a division and then fails
its assertion with bare numbers, we say which division does not come out even, show the arithmetic and
where the world size came from (users' top complaint: numbers without the reason).

With tensor parallelism the engine's train_batch_size is the samples of one optimizer step: micro x gas x
the data-parallel size (the ranks of a tensor-parallel group share their batch). A train_batch_size the
user writes is read as DeepSpeed 0.19 reads it, so gas and micro come out as there: its DeepSpeedConfig
counts the ranks of `mpu.get_data_parallel_world_size()` when initialize gets an mpu, and else every rank
(`dist.get_world_size()`, runtime/config.py, DeepSpeedConfig.__init__), which is the AutoTP case: the
tensor-parallel size comes from tensor_parallel.autotp_size and deepspeed.initialize passes no mpu
(__init__.py). Accelerate writes it that way too (micro x gas x number of processes). With all three keys
given, the data-parallel count is accepted as well (nothing to infer, so nothing is ambiguous).
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

    def by_key(self) -> dict[str, int]:
        """The resolved sizes under their config keys (they replace what the user wrote, "auto" included)."""
        return {TRAIN: self.train, MICRO: self.micro, GAS: self.gas}


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel size the batch keys are read with, and where it came from."""

    size: int
    source: str
    """What set it, for messages: "tensor_parallel.autotp_size", "the model-parallel groups (mpu=)"."""
    from_config: bool
    """True when only the config's tensor_parallel.autotp_size set it (no mpu=, no groups made before):
    DeepSpeed then counts every rank in a written train_batch_size."""


@dataclass(frozen=True)
class _Count:
    """The ranks one batch equation multiplies by: how many, their name in messages, and their origin."""

    ranks: int
    name: str
    origin: str


def resolve_batch_sizes(
    train: int | None,
    micro: int | None,
    gas: int | None,
    *,
    world_size: int,
    world_size_source: str,
    tensor_parallel: TensorParallel | None = None,
) -> tuple[BatchSizes | None, list[str], list[str]]:
    """(sizes or None, problems, notes on what was inferred). `tensor_parallel` must divide world_size."""
    tp = tensor_parallel
    if tp is None or tp.size <= 1:
        origin = f"world size {world_size} detected from {world_size_source}"
        return _resolve(train, micro, gas, _Count(world_size, "world size", origin))
    return _resolve_tensor_parallel(train, micro, gas, world_size, world_size_source, tp)


def _resolve_tensor_parallel(
    train: int | None,
    micro: int | None,
    gas: int | None,
    world_size: int,
    world_size_source: str,
    tp: TensorParallel,
) -> tuple[BatchSizes | None, list[str], list[str]]:
    dp = world_size // tp.size
    origin = (
        f"world size {world_size} ({world_size_source}), tensor-parallel size {tp.size} (from {tp.source}), "
        f"data-parallel size {dp} = {world_size} / {tp.size}"
    )
    data_parallel = _Count(dp, "data-parallel size", origin)
    if train is None:  # nothing written to read: train_batch_size is the samples per step
        return _resolve(None, micro, gas, data_parallel)
    if tp.from_config:
        how = (
            "with the tensor-parallel size from tensor_parallel.autotp_size, DeepSpeed counts every rank in "
            f"{TRAIN} (as Accelerate writes it: micro x gas x number of processes)"
        )
    else:
        how = f"with the model-parallel groups given to initialize, DeepSpeed counts the data-parallel ranks in {TRAIN}"
    every_rank = _Count(world_size, "world size", f"{origin}; {how}")
    if micro is not None and gas is not None:
        return _check_written_triple(train, micro, gas, every_rank, data_parallel)
    sizes, problems, notes = _resolve(train, micro, gas, every_rank if tp.from_config else data_parallel)
    if sizes is None:
        return None, problems, notes
    return _per_step(sizes, train, dp, notes)


def _check_written_triple(
    train: int, micro: int, gas: int, every_rank: _Count, data_parallel: _Count
) -> tuple[BatchSizes | None, list[str], list[str]]:
    """All three written with tensor parallelism: train may count every rank or the data-parallel ranks."""
    counted = micro * gas * every_rank.ranks
    per_step = micro * gas * data_parallel.ranks
    if train in (counted, per_step):
        return _per_step(BatchSizes(train, micro, gas), train, data_parallel.ranks, [])
    message = (
        f"{TRAIN} ({train}) is neither {MICRO} ({micro}) x {GAS} ({gas}) x world size ({every_rank.ranks}) = "
        f"{counted} nor x data-parallel size ({data_parallel.ranks}) = {per_step}; {every_rank.origin}; fix: set "
        f"{TRAIN} to {counted} (every rank, as DeepSpeed and Accelerate count it with AutoTP) or {per_step} (the "
        "samples of one step), or remove one of the three keys so it is inferred from the other two"
    )
    return None, [message], []


def _per_step(sizes: BatchSizes, written: int, dp: int, notes: list[str]) -> tuple[BatchSizes, list[str], list[str]]:
    """`sizes` with train = the samples of one optimizer step, noting when the written value counted more ranks."""
    samples = sizes.micro * sizes.gas * dp
    if samples != written:
        note = (
            f"{TRAIN} {written} counts every rank ({sizes.micro} x {sizes.gas} x world size "
            f"{written // (sizes.micro * sizes.gas)}), as DeepSpeed does; samples per optimizer step "
            f"(engine.train_batch_size()): {sizes.micro} x {sizes.gas} x data-parallel size {dp} = {samples}"
        )
        notes = [*notes, note]
    return BatchSizes(samples, sizes.micro, sizes.gas), [], notes


def _resolve(
    train: int | None, micro: int | None, gas: int | None, count: _Count
) -> tuple[BatchSizes | None, list[str], list[str]]:
    """DeepSpeed's rules (runtime/config.py, _set_batch_related_parameters and _batch_assertion) with
    `count` as its world size."""
    ws, name, origin = count.ranks, count.name, count.origin
    if train is not None and micro is not None and gas is not None:
        product = micro * gas * ws
        if train != product:
            message = (
                f"{TRAIN} ({train}) != {MICRO} ({micro}) x {GAS} ({gas}) x {name} ({ws}) = "
                f"{product}; {origin}; fix: set {TRAIN} to {product}, or remove one of the three "
                "keys so it is inferred from the other two"
            )
            return None, [message], []
        return BatchSizes(train, micro, gas), [], []
    if train is not None and micro is not None:
        inferred = _divide(train, micro * ws, f"{MICRO} ({micro}) x {name} ({ws})", GAS, origin)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, micro, inferred), [], [_note(GAS, inferred, f"{train} / ({micro} x {ws})")]
    if train is not None and gas is not None:
        inferred = _divide(train, gas * ws, f"{GAS} ({gas}) x {name} ({ws})", MICRO, origin)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, inferred, gas), [], [_note(MICRO, inferred, f"{train} / ({gas} x {ws})")]
    if micro is not None and gas is not None:
        total = micro * gas * ws
        return BatchSizes(total, micro, gas), [], [_note(TRAIN, total, f"{micro} x {gas} x {ws}")]
    if train is not None:
        inferred = _divide(train, ws, f"{name} ({ws})", MICRO, origin, gas_default=True)
        if isinstance(inferred, str):
            return None, [inferred], []
        return BatchSizes(train, inferred, 1), [], [_note(MICRO, inferred, f"{train} / {ws} with {GAS} 1")]
    if micro is not None:
        return BatchSizes(micro * ws, micro, 1), [], [_note(TRAIN, micro * ws, f"{micro} x 1 x {ws}")]
    only_gas = f" ({GAS} alone is not enough)" if gas is not None else ""
    message = (
        f"neither {TRAIN} nor {MICRO} is set{only_gas}; fix: set {MICRO} (samples per rank per "
        f"micro-step) and optionally {GAS}; {TRAIN} is then {MICRO} x {GAS} x {name}"
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
