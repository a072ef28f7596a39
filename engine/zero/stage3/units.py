"""Stage 3's gather units as data: their sharded groups, their state, and how they are built.

Each gather unit (which parameters: engine/zero/stage3/unit_plan.py) keeps, per optimizer param group and dtype,
one group in the shared flat layout (engine/zero/layout.py) with a single bucket: rank r stores slice
r (its *shard*, which in fp32 is also the optimizer's master), one all-gather fetches the whole unit
and one reduce-scatter returns its gradients. A unit is in one `UnitState` at a time and each of its
trainable groups in one `GradState`; both move only through `move()`, which refuses a transition not in
the table (a bug in the engine, named with the unit and both states, instead of a silent wrong
gradient or a hang). Gathering and releasing a unit is engine/zero/stage3/gather.py's, reducing its
gradients engine/zero/stage3/grads.py's.

Between uses a parameter's `.data` is empty; its full shape is kept in the group (`shapes`) and, for
Hugging Face and DeepSpeed-aware code, in `param.ds_shape` / `param.ds_numel`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from engine.config import run_checks
from engine.ops.overflow import KnownSquares
from engine.zero import partitioned_init, released, shard_reduce
from engine.zero.fragments import HeldGroup
from engine.zero.layout import GroupLayout, build_layout
from engine.zero.leaf_modules import mark_leaf_parameters
from engine.zero.stage3.unit_plan import leaf_test, plan_units, user_leaves
from engine.zero.state_moves import check_move


class UnitState(enum.Enum):
    """Where a unit's parameters are (FSDP2's ShardedState)."""

    PARTITIONED = "partitioned"
    """Only the shards exist: every parameter's `.data` is empty and no gathered buffer is held."""
    GATHERING = "gathering"
    """Prefetched: its all-gathers were started into fresh full buffers and not yet waited for; the
    parameters are still empty until its use waits for them (see [Note: prefetch])."""
    GATHERED = "gathered"
    """The full buffers hold the whole unit and every parameter's `.data` is a view into them."""


_UNIT_MOVES: dict[UnitState, frozenset[UnitState]] = {
    UnitState.PARTITIONED: frozenset({UnitState.GATHERING, UnitState.GATHERED}),
    UnitState.GATHERING: frozenset({UnitState.GATHERED, UnitState.PARTITIONED}),
    UnitState.GATHERED: frozenset({UnitState.PARTITIONED}),
}
"""The legal moves: a gather (prefetched or not), a release, and dropping a prefetch nobody used."""


class GradState(enum.Enum):
    """Where a trainable group's gradients of this accumulation window are.

    A backward fills the group's gradient bucket (FILLING), reduce-scatters it into the fp32 shard
    gradient (REDUCING), and recycles the bucket (REDUCED). The next backward of the same window adds
    to what was reduced: ACCUMULATING and ADDING are FILLING and REDUCING with a reduced gradient
    already in `shard_grad`. zero_grad (a new window) returns every group to EMPTY."""

    EMPTY = "empty"
    """No gradient of this window: no bucket, nothing in flight, `shard_grad` stale."""
    FILLING = "filling"
    """Some of this backward's gradients are in `grad_bucket` (`arrived` says which)."""
    REDUCING = "reducing"
    """`grad_bucket` is being reduce-scattered into `shard_grad` (`pending`), which it overwrites."""
    REDUCED = "reduced"
    """`shard_grad` holds this window's reduced gradient; no bucket, nothing in flight."""
    ACCUMULATING = "accumulating"
    """REDUCED, and a later backward's gradients are filling `grad_bucket`."""
    ADDING = "adding"
    """REDUCED, and `grad_bucket` is being reduce-scattered onto `shard_grad` (`pending`)."""


_GRAD_MOVES: dict[GradState, frozenset[GradState]] = {
    GradState.EMPTY: frozenset({GradState.FILLING, GradState.REDUCING}),  # REDUCING: zeros, none arrived here
    GradState.FILLING: frozenset({GradState.REDUCING}),
    GradState.REDUCING: frozenset({GradState.REDUCED}),
    GradState.REDUCED: frozenset({GradState.ACCUMULATING, GradState.ADDING}),
    GradState.ACCUMULATING: frozenset({GradState.ADDING}),
    GradState.ADDING: frozenset({GradState.REDUCED}),
}
"""The legal moves besides zero_grad's return to EMPTY, which any state may take."""

_IN_BUCKET = frozenset({GradState.FILLING, GradState.ACCUMULATING})
_IN_FLIGHT = frozenset({GradState.REDUCING, GradState.ADDING})
_WRITTEN = frozenset({GradState.REDUCED, GradState.ACCUMULATING, GradState.ADDING})


_DS_STATUS = {
    UnitState.PARTITIONED: released.ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: released.ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: released.ZeroParamStatus.AVAILABLE,
}


@dataclass(kw_only=True)
class ShardedGroup:
    """The parameters of one unit that share an optimizer param group and a dtype."""

    params: list[torch.nn.Parameter]
    names: list[str]
    shapes: list[tuple[int, ...]]
    """Each parameter's full shape (its `.data` is empty while the unit is partitioned)."""
    layout: GroupLayout
    shard: torch.Tensor | None
    """This rank's slice of the unit's flat buffer in the parameter dtype: the persistent storage of
    frozen and fp32 parameters. None for trainable low-precision groups, whose only copy is the fp32
    master (cast while gathering, as FSDP2 does: 4 instead of 2 + 4 bytes per element)."""
    opt_group: int | None = None
    """Index of the optimizer param group; None for frozen parameters (gathered, never updated)."""
    dtype: torch.dtype
    device: torch.device
    unit_name: str
    full: torch.Tensor | None = None
    """1D, the whole unit's group in the layout (padded): the gathered buffer while the unit is
    GATHERING or GATHERED, None otherwise."""

    def stored(self) -> torch.Tensor:
        """What this rank keeps of the group: the shard (frozen groups)."""
        assert self.shard is not None, "a frozen group always keeps its shard"
        return self.shard


@dataclass(kw_only=True)
class TrainableGroup(ShardedGroup):
    """A group the optimizer updates: its fp32 master and gradient state on this rank."""

    opt_group: int
    master: torch.Tensor
    """fp32 optimizer parameter: the shard itself in fp32, a copy otherwise."""
    shard_grad: torch.Tensor
    """The master's gradient, in the accumulation dtype: this rank's slice of the unit's reduced gradients."""
    grad_state: GradState = GradState.EMPTY
    """The one record of where this window's gradients are; the three fields below are its data."""
    grad_bucket: torch.Tensor | None = None
    """1D, padded like `full`, in the wire dtype: held while FILLING/ACCUMULATING/REDUCING/ADDING."""
    arrived: set[int] = field(default_factory=set)
    """Indices (in `params`) of the parameters whose gradient is in `grad_bucket` (FILLING/ACCUMULATING)."""
    slotted: set[int] = field(default_factory=set)
    """Indices of the parameters whose slot of `grad_bucket` was lent in this backward (UnitGradients.slot)."""
    pending: shard_reduce.PendingReduce | None = None
    """The reduce-scatter of `grad_bucket` in flight (REDUCING/ADDING)."""
    norm_squares: KnownSquares | None = None
    """The norm's partial sums of `shard_grad` as this window's last reduction left it (NVMe: taken while
    the values are in memory, see UnitGradients); None where not taken, and from zero_grad on."""

    def move_grads(self, to: GradState) -> None:
        """Take a transition of `_GRAD_MOVES` (or zero_grad's to EMPTY); anything else is a bug, refused."""
        if to is not GradState.EMPTY:
            check_move(f"stage 3: the gradients of unit {self.unit_name!r}", self.grad_state, to, _GRAD_MOVES)
        self.grad_state = to

    @property
    def filling(self) -> bool:
        """This backward's gradients are arriving in `grad_bucket`."""
        return self.grad_state in _IN_BUCKET

    @property
    def in_flight(self) -> bool:
        return self.grad_state in _IN_FLIGHT

    @property
    def grad_written(self) -> bool:
        """`shard_grad` holds a reduced gradient of this accumulation window (later ones add to it)."""
        return self.grad_state in _WRITTEN

    def stored(self) -> torch.Tensor:
        """The fp32 master: the shard itself for fp32 groups, whose gathers then cast nothing."""
        return self.master

    def held(self, rank: int) -> HeldGroup:
        """The group as `rank` holds it, for DeepSpeed's tensor-fragment functions (engine/zero/fragments.py)."""
        return HeldGroup(
            params=self.params,
            names=self.names,
            shapes=self.shapes,
            pieces=self.layout.rank_pieces(rank),
            master=self.master,
            grad=self.shard_grad,
            grad_ready=lambda: self.grad_written,
            write_whole=self._write_whole,
            grads_changed=self._forget_norm,
        )

    def _write_whole(self, i: int, value: torch.Tensor) -> None:
        """A new whole value of parameter i reaches the gathered buffer, if the unit is gathered (the master's
        runs are the persistent copy, written by the caller; a gather casts from them)."""
        if self.full is not None:
            span = self.layout.params[i]
            self.full[span.offset : span.end].copy_(value.reshape(-1))

    def _forget_norm(self) -> None:
        self.norm_squares = None  # taken from values the user has since replaced


@dataclass
class Unit:
    index: int
    name: str
    modules: list[torch.nn.Module]
    """Whose forwards use it (see unit_plan.UnitPlan); empty for the root unit."""
    groups: list[ShardedGroup]
    state: UnitState = UnitState.PARTITIONED
    """The one record of where its parameters are; change it only with `move()`."""

    def move(self, to: UnitState) -> None:
        """Take a transition of `_UNIT_MOVES`; anything else is a bug in the engine, refused by name."""
        check_move(f"stage 3: unit {self.name!r}", self.state, to, _UNIT_MOVES)
        self.state = to

    def ds_status(self) -> released.ZeroParamStatus:
        """DeepSpeed's `param.ds_status` of every parameter of the unit."""
        return _DS_STATUS[self.state]

    @property
    def trainable(self) -> list[TrainableGroup]:
        return [g for g in self.groups if isinstance(g, TrainableGroup)]

    @property
    def numel(self) -> int:
        """Elements of its gathered buffers (padded)."""
        return sum(g.layout.padded_numel for g in self.groups)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole parameter's shape, also when engine.zero.Init has partitioned it (`.data` empty)."""
    if partitioned_init.is_partitioned(param):
        return partitioned_init.full_shape(param)
    return tuple(param.shape)


def build_units(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    leaf_module: Mapping[str, Iterable[str]] | None,
    merge_below: int,
    *,
    world: int,
    rank: int,
    grad_dtype: Callable[[torch.dtype], torch.dtype],
    allocate_grads: bool = True,
) -> list[Unit]:
    """Plan the units (engine/zero/stage3/unit_plan.py) and shard each: afterwards every parameter is empty and
    this rank holds its slices (parameters built under engine.zero.Init are re-laid from their own
    partition, all-gathering one parameter at a time). Gradient shards are in grad_dtype(param dtype),
    zeros in memory, or (allocate_grads=False: the caller places them, e.g. in swap files) empty."""
    opt_groups = optimizer.param_groups if optimizer is not None else []
    group_of = {id(p): gi for gi, g in enumerate(opt_groups) for p in g["params"] if p.requires_grad}
    is_leaf = leaf_test(leaf_module)
    if leaf_module:
        run_checks.check_leaf_module(
            leaf_module, type(module).__name__, any(is_leaf(n, m) for n, m in module.named_modules() if m is not module)
        )
    for _, leaf in user_leaves(module, is_leaf):  # read by deepspeed.utils.z3_leaf_parameter
        mark_leaf_parameters(leaf)
    units: list[Unit] = []
    for plan in plan_units(module, is_leaf, merge_below=merge_below):
        keys: dict[tuple[int | None, torch.dtype], list[int]] = {}
        for i, p in enumerate(plan.params):
            keys.setdefault((group_of.get(id(p)), p.dtype), []).append(i)
        groups = [
            shard_group(
                [plan.params[i] for i in idx],
                [plan.param_names[i] for i in idx],
                opt_group,
                unit_name=plan.name,
                world=world,
                rank=rank,
                grad_dtype=grad_dtype(dtype),
                allocate_grad=allocate_grads,
            )
            for (opt_group, dtype), idx in keys.items()
        ]
        units.append(Unit(len(units), plan.name, plan.modules, groups))
    return units


def unit_layout(shapes: list[tuple[int, ...]], *, world_size: int, element_size: int) -> GroupLayout:
    """A stage-3 group's layout: one bucket holding all its parameters, one slice per rank (also what
    engine.estimate counts)."""
    return build_layout(
        shapes, world_size=world_size, bucket_size=max(1, sum(math.prod(s) for s in shapes)), element_size=element_size
    )


def shard_group(
    params: list[torch.nn.Parameter],
    names: list[str],
    opt_group: int | None,
    *,
    unit_name: str,
    world: int,
    rank: int,
    grad_dtype: torch.dtype,
    allocate_grad: bool = True,
) -> ShardedGroup:
    """Lay `params` (one dtype) out flat, keep this rank's slice, and leave each parameter empty."""
    shapes = [full_shape(p) for p in params]
    for p, shape in zip(params, shapes):
        if not partitioned_init.is_partitioned(p):
            partitioned_init.set_full_shape(p, shape)  # DeepSpeed's ds_shape/ds_numel, read by Hugging Face
    layout = unit_layout(shapes, world_size=world, element_size=params[0].element_size())
    assert layout.num_buckets == 1
    dtype, device = params[0].dtype, params[0].device
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for p, span in zip(params, layout.params):
        # Built under engine.zero.Init: re-laid from its own partition (one parameter at a time).
        value = partitioned_init.full_value(p, dtype).to(device) if partitioned_init.is_partitioned(p) else p.data
        flat[span.offset : span.end].copy_(value.reshape(-1))
        del value
    start, end = layout.slice_range(0, rank)
    shard = flat[start:end].clone()
    del flat
    for p, name, span in zip(params, names, layout.params):
        p.data = torch.empty(0, dtype=dtype, device=device)
        if partitioned_init.is_partitioned(p):
            partitioned_init.drop_shard(p)
        released.adopt(p, name, partition_numel=max(0, min(end, span.end) - max(start, span.offset)))
    if opt_group is None:
        return ShardedGroup(
            params=params,
            names=names,
            shapes=shapes,
            layout=layout,
            shard=shard,
            dtype=dtype,
            device=device,
            unit_name=unit_name,
        )
    master = shard if dtype == torch.float32 else shard.to(torch.float32)
    shard_grad = torch.zeros(layout.slice_numel if allocate_grad else 0, dtype=grad_dtype, device=device)
    return TrainableGroup(
        params=params,
        names=names,
        shapes=shapes,
        layout=layout,
        shard=shard if dtype == torch.float32 else None,
        opt_group=opt_group,
        dtype=dtype,
        device=device,
        unit_name=unit_name,
        master=master,
        shard_grad=shard_grad,
    )
