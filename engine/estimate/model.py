"""Model-state memory per rank for each ZeRO stage, in this engine's dtypes (the ZeRO paper's Table 1).

Per rank, with Psi trainable elements (real, no padding), N ranks, and per element: b bytes of the
parameter dtype, g bytes of the gradient-accumulation dtype (DeepSpeed's `data_types.grad_accum_dtype`,
default the parameter dtype: bf16 training keeps bf16 gradients), m = 0 in fp32 training (the
optimizer updates the fp32 parameter storage in place) and 4 otherwise (the fp32 master), s bytes of
optimizer state (Adam 8):

    stage  params                   gradients  master  optimizer
    0      b P                      g P        m P     s Psi    (one master view per parameter)
    1      b P                      g P        m S     s S      (the shard is a view of the full buffer)
    2      b P                      g S        m S     s S
    3      4 S in fp32, else 0      g S        m S     s S

P is the padded element count of the full flat buffers and S that of this rank's shard. For an
element count, P = Psi and S = ceil(Psi / N) (the largest rank's shard). For a module they come from
the engine's own layout code (engine/zero/layout.py), so bucket padding is counted exactly: one flat
group per dtype at stages 0-2 (world size 1 at stage 0, where S = P), one group per gather unit at
stage 3 (engine/zero/stage3/unit_plan.py). At stage 3 the fp32 shard is both the parameters and the master in
fp32 training; in bf16/fp16 no low-precision shard is kept (gathers cast from the fp32 master).

The paper (Table 1) assumes fp16 parameters and gradients, K = 12 bytes of optimizer state (fp32
master 4 + Adam's moments 8) and an fp16 parameter shard at stage 3: 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N
and 16 Psi/N for stages 1-3. The same per-state formulas above, fed the paper's byte costs
(PAPER_COSTS), reproduce all 54 printed cells: `python -m engine.estimate --paper`. This engine in
bf16 holds 14 Psi/N at stage 3, not 16. Only model states are counted: constant-size bucket buffers,
gathered stage-3 units, activations and allocator overhead are not.

    python -m engine.estimate --params 7.5e9 --world-size 64 --dtype bf16
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import overload

import torch

from engine.config.types import DEEPSPEED_BUCKET_SIZE
from engine.zero.layout import build_layout
from engine.zero.partitioned_init import full_shape
from engine.zero.stage3.unit_plan import leaf_test, plan_units
from engine.zero.stage3.units import unit_layout

STAGES = (0, 1, 2, 3)
DEFAULT_BUCKET_SIZE = DEEPSPEED_BUCKET_SIZE
"""DeepSpeed's default zero_optimization.reduce_bucket_size, in elements."""

DTYPE_NAMES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}
_TORCH_DTYPES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8,  # exp_avg + exp_avg_sq in fp32
    "adamw": 8,
    "lamb": 8,
    "sgd": 4,  # momentum buffer (assumed; plain SGD would be 0)
    "adagrad": 4,  # sum of squares
    "lion": 4,  # exp_avg only
}

STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


@dataclass(frozen=True)
class ByteCosts:
    """What one element costs in each model state: the assumptions behind an estimate."""

    dtype: str
    """Canonical name of the parameter dtype."""
    grad_accum_dtype: str
    """Canonical name of the dtype the gradients are held in."""
    optimizer: str
    """Canonical (lower-case) optimizer name."""
    params: int
    """Bytes per parameter element (b)."""
    gradients: int
    """Bytes per gradient element (g)."""
    master: int
    """Bytes of the fp32 master per element (m): 0 when the parameters themselves are updated in place."""
    optimizer_state: int
    """Optimizer-state bytes per element (s)."""
    stage3_param_shard: bool
    """Whether stage 3 keeps a shard in the parameter dtype (b S bytes) besides the master."""


PAPER_COSTS = ByteCosts(
    dtype="fp16",
    grad_accum_dtype="fp16",
    optimizer="adam",
    params=2,
    gradients=2,
    master=4,
    optimizer_state=8,  # K = 12 = master + Adam's two moments
    stage3_param_shard=True,  # P_os+g+p keeps 2 Psi/N of fp16 parameters: 16 Psi/N in all
)
"""The ZeRO paper's assumptions for Table 1 (section 3.1 and 5)."""


def engine_costs(
    dtype: str | torch.dtype = "fp32",
    grad_accum_dtype: str | torch.dtype | None = None,
    optimizer: str = "adam",
) -> ByteCosts:
    """This engine's byte costs; `grad_accum_dtype` None means the parameter dtype (DeepSpeed's default)."""
    param_dtype = _dtype_name(dtype, "dtype")
    grad_dtype = param_dtype if grad_accum_dtype is None else _dtype_name(grad_accum_dtype, "grad_accum_dtype")
    opt = _optimizer_name(optimizer)
    fp32 = param_dtype == "fp32"
    return ByteCosts(
        dtype=param_dtype,
        grad_accum_dtype=grad_dtype,
        optimizer=opt,
        params=_DTYPE_BYTES[param_dtype],
        gradients=_DTYPE_BYTES[grad_dtype],
        master=0 if fp32 else 4,  # fp32: the optimizer updates the parameter storage in place
        optimizer_state=OPTIMIZER_STATE_BYTES[opt],
        # fp32: the stage-3 shard is the parameters and the master; bf16/fp16: gathers cast from the master.
        stage3_param_shard=fp32,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes held by one rank at one ZeRO stage."""

    stage: int
    world_size: int
    numel: int
    """Psi: trainable elements (shared parameters counted once, no padding)."""
    padded_numel: int
    """P: elements of the full flat buffers, padding included (Psi for an element count)."""
    shard_numel: int
    """S: elements of this rank's shard, padding included (ceil(Psi / N) for an element count; P at stage 0)."""
    params: int
    """Bytes of the parameters: b P at stages 0-2; at stage 3 the fp32 shard (4 S) or nothing (bf16/fp16)."""
    gradients: int
    """Bytes of gradients in the accumulation dtype: the full buffer (g P) at stages 0-1, a shard (g S) from 2."""
    master: int
    """Bytes of the fp32 master (m P at stage 0, m S from stage 1); 0 in fp32 training (updated in place)."""
    optimizer_state: int
    """Bytes of optimizer state (e.g. Adam's two moments): s Psi at stage 0, s S from stage 1."""
    costs: ByteCosts
    """The per-element byte costs assumed."""
    disk: int = 0
    """Bytes in NVMe swap files (ZeRO-Infinity, `on_nvme`): model states moved out of memory, so not
    in the four fields above nor in `total`."""
    secondary: int = 0
    """Stage 3 with hpZ (zero_hpz_partition_size k): the secondary shards at their peak, b P / k (each
    trainable unit's 1/k in the parameter dtype, held from its training forward to its backward; at the end
    of the forward all of them). Counted in `total`: memory the rank holds while it trains."""

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.master + self.optimizer_state + self.secondary

    @property
    def dtype(self) -> str:
        return self.costs.dtype

    @property
    def grad_accum_dtype(self) -> str:
        return self.costs.grad_accum_dtype

    @property
    def optimizer(self) -> str:
        return self.costs.optimizer


def estimate_from_costs(
    costs: ByteCosts, stage: int, *, world_size: int, numel: int, padded_numel: int, shard_numel: int
) -> MemoryEstimate:
    """The per-state formulas of the module docstring: the engine's estimates and the paper's cells both."""
    full, shard = padded_numel, shard_numel
    if stage == 3:
        params = costs.params * shard if costs.stage3_param_shard else 0
    else:
        params = costs.params * full
    return MemoryEstimate(
        stage=stage,
        world_size=world_size,
        numel=numel,
        padded_numel=padded_numel,
        shard_numel=shard_numel,
        params=params,
        gradients=costs.gradients * (full if stage <= 1 else shard),
        master=costs.master * (full if stage == 0 else shard),
        optimizer_state=costs.optimizer_state * (numel if stage == 0 else shard),
        costs=costs,
    )


# ------------------------------------------------------------------------------------ P and S
def count_sizes(numel: int, stage: int, world_size: int) -> tuple[int, int]:
    """(P, S) for a bare element count: no padding, the largest rank's shard."""
    if stage == 0:
        return numel, numel
    return numel, -(-numel // world_size)  # ceil without float rounding


def flat_sizes(
    params: Sequence[torch.nn.Parameter], stage: int, world_size: int, bucket_size: int, element_size: int
) -> tuple[int, int]:
    """(P, S) at stages 0-2: all trainable parameters in one flat group, laid out as the flat stages do."""
    if not params:
        return 0, 0
    shapes = [full_shape(p) for p in reversed(params)]  # gradient-arrival order (it doesn't change P or S)
    layout = build_layout(
        shapes, world_size=1 if stage == 0 else world_size, bucket_size=bucket_size, element_size=element_size
    )
    return layout.padded_numel, layout.shard_numel


def unit_sizes(model: torch.nn.Module, world_size: int, element_size: int) -> tuple[int, int]:
    """(P, S) at stage 3: one group per gather unit of the default plan, each a single bucket
    (engine/zero/stage3/units.py: build_units and shard_group). plan_units only reads the module."""
    padded = shard = 0
    for plan in plan_units(model, leaf_test(None), merge_below=0):
        shapes = [full_shape(p) for p in plan.params if p.requires_grad]
        if not shapes:
            continue  # frozen parameters only: no model states
        layout = unit_layout(shapes, world_size=world_size, element_size=element_size)
        padded += layout.padded_numel
        shard += layout.shard_numel
    return padded, shard


def _sizes(
    model_or_numel: torch.nn.Module | int, stage: int, world_size: int, bucket_size: int, element_size: int
) -> tuple[int, int, int]:
    """(Psi, P, S) of a module or an element count at one stage."""
    if not isinstance(model_or_numel, torch.nn.Module):
        return (model_or_numel, *count_sizes(model_or_numel, stage, world_size))
    params = [p for p in model_or_numel.parameters() if p.requires_grad]  # a tied parameter once
    numel = sum(math.prod(full_shape(p)) for p in params)
    if stage == 3:
        return (numel, *unit_sizes(model_or_numel, world_size, element_size))
    return (numel, *flat_sizes(params, stage, world_size, bucket_size, element_size))


# ------------------------------------------------------------------------------ public API
@overload
def estimate_memory(
    model_or_numel: torch.nn.Module | int,
    stage: None = None,
    world_size: int = 1,
    dtype: str | torch.dtype = "fp32",
    grad_accum_dtype: str | torch.dtype | None = None,
    optimizer: str = "adam",
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    hpz_partition_size: int = 1,
) -> list[MemoryEstimate]: ...


@overload
def estimate_memory(
    model_or_numel: torch.nn.Module | int,
    stage: int,
    world_size: int = 1,
    dtype: str | torch.dtype = "fp32",
    grad_accum_dtype: str | torch.dtype | None = None,
    optimizer: str = "adam",
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    hpz_partition_size: int = 1,
) -> MemoryEstimate: ...


def estimate_memory(
    model_or_numel: torch.nn.Module | int,
    stage: int | None = None,
    world_size: int = 1,
    dtype: str | torch.dtype = "fp32",
    grad_accum_dtype: str | torch.dtype | None = None,
    optimizer: str = "adam",
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    hpz_partition_size: int = 1,
) -> MemoryEstimate | list[MemoryEstimate]:
    """Per-rank model-state bytes at `stage` (0-3), or a list for stages 0..3 when `stage` is None.

    `model_or_numel` is a module (parameters with requires_grad, each shared parameter once, all
    assumed cast to `dtype` and in one optimizer param group) or an element count. `grad_accum_dtype`
    None means `dtype` (DeepSpeed's default). `bucket_size` is reduce_bucket_size in elements; it
    only matters for a module (bucket padding). See the module docstring for the formulas.
    `offload_optimizer` / `offload_param` ("none", "cpu", "nvme"): DeepSpeed's offload devices; "nvme"
    moves what the engine keeps in swap files to `disk` (see `on_nvme`); "cpu" changes nothing on a
    CPU machine (the states are in host memory either way). `hpz_partition_size` k > 1 adds hpZ's secondary
    shards at stage 3 (`MemoryEstimate.secondary`).
    """
    _check_int(hpz_partition_size, "hpz_partition_size", "zero_hpz_partition_size, 1 for off")
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f'{name}={device!r} is not an offload device; use "none", "cpu" or "nvme"')
    _check_int(world_size, "world_size", "the number of data-parallel ranks")
    _check_int(bucket_size, "bucket_size", "reduce_bucket_size in elements")
    if stage is not None and (isinstance(stage, bool) or stage not in STAGES):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3 (or None for all four)")
    if not isinstance(model_or_numel, torch.nn.Module):
        _check_count(model_or_numel)
    costs = engine_costs(dtype, grad_accum_dtype, optimizer)
    estimates = []
    for s in STAGES if stage is None else (stage,):
        numel, padded, shard = _sizes(model_or_numel, s, world_size, bucket_size, costs.params)
        estimate = estimate_from_costs(
            costs, s, world_size=world_size, numel=numel, padded_numel=padded, shard_numel=shard
        )
        if s == 3 and hpz_partition_size > 1:
            estimate = replace(estimate, secondary=costs.params * padded // hpz_partition_size)
        estimates.append(on_nvme(estimate, offload_optimizer == "nvme", offload_param == "nvme"))
    return estimates[0] if stage is not None else estimates


def on_nvme(e: MemoryEstimate, optimizer: bool, params: bool) -> MemoryEstimate:
    """`e` with what ZeRO-Infinity keeps in swap files moved to `disk` (engine/offload/optimizer_swap.py):
    with the optimizer on NVMe (stages 1-3) its state, and the fp32 master where it is a copy of a
    low-precision shard (stages 1-2); with parameters on NVMe too (stage 3) the fp32 shard, which is
    the master (fp32: `params`; bf16/fp16: `master`). At stage 3 the shard gradients too (mapped swap
    files, engine/offload/mapped_file.py). Stage 0 offloads nothing."""
    if e.stage == 0 or not optimizer:
        return e
    master = e.stage in (1, 2) or params
    shard = params and e.stage == 3
    grads = e.stage == 3
    disk = e.optimizer_state + (e.master if master else 0) + (e.params if shard else 0) + (e.gradients if grads else 0)
    return replace(
        e,
        optimizer_state=0,
        master=0 if master else e.master,
        params=0 if shard else e.params,
        gradients=0 if grads else e.gradients,
        disk=e.disk + disk,
    )


def _dtype_name(dtype: str | torch.dtype, what: str) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[dtype]
    elif isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    accepted = ", ".join(repr(name) for name in DTYPE_NAMES)
    raise ValueError(f"{what}={dtype!r} is not supported; use one of {accepted} or torch.float32/bfloat16/float16")


def _optimizer_name(optimizer: str) -> str:
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if name not in OPTIMIZER_STATE_BYTES:
        accepted = ", ".join(repr(n) for n in OPTIMIZER_STATE_BYTES)
        raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {accepted} (case-insensitive)")
    return name


def _check_int(value: object, name: str, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 ({meaning})")


def _check_count(numel: object) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"model_or_numel must be an nn.Module or an int, got {type(numel).__name__}")
    if numel < 0:
        raise ValueError(f"model_or_numel={numel} must be >= 0 (a count of trainable elements)")
