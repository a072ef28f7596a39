"""Stage 3's gathers: full parameters exist only while the unit that owns them computes (paper 5.3,
7.2.2). This module runs the all-gathers and releases; which units to prefetch or keep is the
PrefetchPlan's (engine/zero/stage3/prefetch.py, [Note: prefetch]).

Lifecycle of a unit (engine/zero/stage3/units.py, UnitState) in a step:

    forward pre-hook   gather: PARTITIONED -> GATHERED (all-gather into a fresh full buffer, or wait
                       for the one prefetched: GATHERING -> GATHERED); params' .data become views
    forward post-hook  release (GATHERED -> PARTITIONED, params' .data empty) unless the plan keeps
                       it, and wrap the outputs so that
    backward           the unit is gathered again right before its backward runs
    grad hooks         when all of the unit's gradients are in and reduced in order
                       (engine/zero/stage3/grads.py), the unit is released

The root unit (parameters outside the repeated blocks: embeddings, final norm, a tied head) is
gathered when the model's forward starts and stays gathered until its gradients are reduced.

# [Note: reads ahead of the all-gather]
With parameters on NVMe (ZeRO-Infinity), a unit's shard is read from its swap file before its
all-gather can send it. The read is started when the unit is (pre)fetched and runs in the aio threads
while the model computes; the all-gather is launched at the next use of any unit (or at this unit's
own use, whichever comes first), after waiting for the read. The all-gathers must be launched in the
same order on every rank (gloo pairs collectives by order), so the launch happens only at those
points, which are the same on every rank, never when a read happens to finish. With nothing read from
disk the all-gather starts at once, as before.

The all-gather prefetch is bounded by stage3_prefetch_bucket_size and stage3_max_live_parameters
(full units); the reads are not: at each use that follows the recorded order, the shards of the next
offload_param.buffer_count units that are not live are read ahead (a shard is 1/world of its unit, and
no collective is involved, so ranks may read at their own pace), and a unit started later takes its
values from there. This is ZeRO-Infinity's read-ahead: with a large embedding in the root unit, or
blocks bigger than the bucket, the gathers are on demand, and without it every one of them would wait
for its disk read (measured at 2.33B parameters: 9.3 s of a 85 s step). Reads ahead nobody used are
dropped at the end of the micro-step, before the step changes the masters.

Gathered buffers are allocated fresh and never recycled while gathered views might still be
referenced: autograd may have saved a view of a weight (e.g. `w.t()`) for backward, and a recycled
buffer would silently feed it another unit's numbers. Released storage is freed by refcounting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from engine import comm
from engine.monitor.log import get_logger
from engine.ops.flatten import copy_into
from engine.zero import released
from engine.zero.stage3.memory import Stage3Memory
from engine.zero.stage3.prefetch import PrefetchPlan, TraceMatch
from engine.zero.stage3.secondary import SecondaryShards
from engine.zero.stage3.units import ShardedGroup, Unit, UnitState

logger = get_logger()


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class UnitGathers:
    """Gathers and releases units, and starts the prefetches the plan asks for."""

    def __init__(
        self,
        units: Sequence[Unit],
        plan: PrefetchPlan,
        memory: Stage3Memory,
        rank: int,
        where: Callable[[], str],
        *,
        grads_sent: Callable[[Unit], bool],
        group: comm.ProcessGroup | None = None,
        secondary: SecondaryShards | None = None,
    ) -> None:
        self.secondary = secondary
        """hpZ's secondary shards (engine/zero/stage3/secondary.py), None without hierarchical partitioning."""
        self.read_stored: Callable[[torch.Tensor], StoredRead] = lambda stored: (stored, None)
        """What a group keeps, as the all-gather sends it: itself, or (parameters on NVMe) a read of its
        values from the swap file started now (engine/offload/optimizer_swap.py's start_read_master)."""
        self.units = units
        self.grads_sent = grads_sent
        """Whether a unit's gradients of this backward were sent (grads.UnitGradients.sent): its outputs'
        backward then needs no gather."""
        self.plan = plan
        self._memory = memory
        self._rank = rank
        """Position in `group`, the data-parallel group units are partitioned over (None: the world)."""
        self._group = group
        self._where = where
        """Where training is (optimizer step, backward), for errors."""
        self.read_ahead_units = 0
        """Parameters on NVMe: how many units' shards may be read ahead of their gather, along the
        recorded order (offload_param.buffer_count); 0 reads a shard only when its unit is started."""
        self._read_ahead: dict[int, GroupReads] = {}
        """Unit index -> the reads of a PARTITIONED unit's stored values, started ahead of its gather."""
        self._reading: dict[int, GroupReads] = {}
        """Unit index -> the reads of its groups' stored values in flight (parameters on NVMe), for a
        GATHERING unit whose all-gathers are not launched yet; see [Note: reads ahead of the all-gather]."""
        self._in_flight: dict[int, list[comm.Handle]] = {}
        """Unit index -> the async all-gathers of a GATHERING unit, in launch order: a use waits for
        its unit's, the end of a micro-step for those nobody used. Data of that state, not a record of
        it: the unit's state says whether it is GATHERING."""
        self.prefetched = 0
        """All-gathers started ahead of use, over the stage's life."""
        self.shards_read_ahead = 0
        """Units started with their shards already read ahead along the recorded order (parameters on
        NVMe, read_ahead_units), over the stage's life."""
        self.reads_ahead = 0
        """Units whose stored values were read from disk while other units computed (their all-gather
        launched at a later use than the read started), over the stage's life."""
        self.gathered_bytes = 0
        """Bytes of full buffers held now (GATHERING and GATHERED units)."""
        self.peak_gathered_bytes = 0

    # ------------------------------------------------------------------------- gather/release
    def live(self) -> set[int]:
        """Units gathered or gathering."""
        return {u.index for u in self.units if u.state is not UnitState.PARTITIONED}

    def _start(self, unit: Unit) -> None:
        """PARTITIONED -> GATHERING: fresh full buffers, and the all-gathers into them started, or (a
        stored value being read from disk) left to _launch once the read is in."""
        # Every buffer first: an allocation that fails (a full arena) then fails before any collective
        # starts, on every rank alike, and leaves nothing allocated.
        fulls = [self._memory.gathered(g.layout.padded_numel, g.dtype, g.device, unit.name) for g in unit.groups]
        for g, full in zip(unit.groups, fulls):
            g.full = full
            self.gathered_bytes += _nbytes(full)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        unit.move(UnitState.GATHERING)
        reads = self._read_ahead.pop(unit.index, None)
        if reads is not None:
            self.shards_read_ahead += 1
        else:
            reads = self._read(unit)
        self._reading[unit.index] = reads
        if not _on_disk(reads):
            self._launch(unit)
        else:
            self.reads_ahead += 1

    def _read(self, unit: Unit) -> GroupReads:
        return [(g, self.read_stored(g.stored())) for g in unit.groups]

    def _start_reads_ahead(self) -> None:
        """Start reading the stored values of the next units in the recorded order that are neither
        live nor read already, up to read_ahead_units of them held at once (no collective: a rank's
        own file reads, so the timing may differ between ranks)."""
        if not self.read_ahead_units:
            return
        for index in self.plan.upcoming(self.live(), self.read_ahead_units):
            if index in self._read_ahead:
                continue
            if len(self._read_ahead) >= self.read_ahead_units:
                break
            reads = self._read(self.units[index])
            if _on_disk(reads):  # else nothing of it is on disk (frozen, or resident for a checkpoint)
                self._read_ahead[index] = reads

    def _drop_reads_ahead(self) -> None:
        """Wait for the reads ahead nobody used and drop their values: the step changes the masters."""
        for reads in self._read_ahead.values():
            _wait(reads)
        self._read_ahead.clear()

    def _launch(self, unit: Unit) -> None:
        """Start a GATHERING unit's all-gathers (waiting for its reads first, if any are still running)."""
        reads = self._reading.pop(unit.index)
        try:
            _wait(reads)  # all of them first: a failed read leaves nothing launched
        except BaseException:  # back to PARTITIONED: a later use gathers it anew
            self._unstart(unit)
            raise
        works = []
        if self.secondary is not None and self.secondary.has(unit.groups):  # a backward's gather (hpZ)
            self._in_flight[unit.index] = [self.secondary.gather(g, _full(g), unit.index) for g in unit.groups]
            return
        for g, (values, _) in reads:
            full = _full(g)
            start, end = g.layout.slice_range(0, self._rank)
            # This rank's slice goes straight into its place in the gathered buffer (cast from the fp32
            # master in the same pass for bf16/fp16), and the all-gather runs in place around it.
            copy_into(full, [values], [start])
            work = comm.all_gather(full, full[start:end], async_op=True, key=unit.index, group=self._group)
            assert work is not None  # async_op=True always returns a handle
            works.append(work)
        self._in_flight[unit.index] = works

    def _unstart(self, unit: Unit) -> None:
        """GATHERING -> PARTITIONED, its full buffers dropped (nothing of it in flight any more)."""
        for g in unit.groups:
            self.gathered_bytes -= _nbytes(_full(g))
            g.full = None
        unit.move(UnitState.PARTITIONED)

    def _launch_read_ahead(self) -> None:
        """Launch the all-gathers of every unit whose read was started before this point (oldest first);
        see [Note: reads ahead of the all-gather]."""
        for index in list(self._reading):
            self._launch(self.units[index])

    def gather(self, unit: Unit) -> None:
        """Make the unit GATHERED (a use: recorded, and the plan may prefetch what follows)."""
        if unit.state is UnitState.GATHERED:  # kept since its last use: still a use in the recorded order
            self._follow_trace(unit)
            return
        if unit.state is UnitState.PARTITIONED:
            self._start(unit)
        if unit.index in self._reading:
            self._launch(unit)
        for work in self._in_flight.pop(unit.index):
            comm.wait(work, f"all-gather of stage-3 unit {unit.name!r} ({self._where()})")
        for g in unit.groups:
            full = _full(g)
            for p, span, shape in zip(g.params, g.layout.params, g.shapes):
                p.data = full[span.offset : span.end].view(shape)
                released.set_released(p, False)
        unit.move(UnitState.GATHERED)
        self._follow_trace(unit)

    def release(self, unit: Unit) -> None:
        """GATHERED -> PARTITIONED: the parameters' .data become empty and the full buffers are dropped
        (freed once no autograd-saved view holds them). A unit in any other state is left alone."""
        if unit.state is not UnitState.GATHERED:
            return
        if self.secondary is not None and unit.trainable:
            if in_backward():  # its backward gathered it: the secondary shard is spent
                self.secondary.drop(unit.groups)
            elif torch.is_grad_enabled():  # a training forward: its backward will gather it from the group
                for g in unit.groups:
                    self.secondary.keep(g, _full(g))
        for g in unit.groups:
            for p in g.params:
                p.data = torch.empty(0, dtype=g.dtype, device=g.device)
                released.set_released(p, True)
            self.gathered_bytes -= _nbytes(_full(g))
            g.full = None
        unit.move(UnitState.PARTITIONED)

    # -------------------------------------------------------------------------------- prefetch
    def _follow_trace(self, unit: Unit) -> None:
        """Record this use and, while the recorded order holds, prefetch the next units."""
        match = self.plan.record(unit.index, in_training=torch.is_grad_enabled() or in_backward())
        self._launch_read_ahead()  # reads started at earlier uses have had this unit's wait to finish
        if match is TraceMatch.FOLLOWED:
            for index in self.plan.to_prefetch(self.live()):
                self._start(self.units[index])
                self.prefetched += 1
            self._start_reads_ahead()
        elif match is TraceMatch.DIVERGED:
            logger.debug(
                "stage 3: unit %s gathered out of the recorded order; gathering on demand and re-recording", unit.name
            )

    def drop_prefetched(self) -> None:
        """GATHERING -> PARTITIONED for gathers nobody used: wait for them (collectives cannot be
        cancelled) and free their buffers; reads ahead nobody used are dropped too."""
        self._drop_reads_ahead()
        for unit in self.units:
            if unit.state is not UnitState.GATHERING:
                continue
            if unit.index in self._reading:  # read, never sent: wait for the reads and drop them
                _wait(self._reading.pop(unit.index))
                self._in_flight[unit.index] = []
            for work in self._in_flight.pop(unit.index):
                comm.wait(work, "a prefetched all-gather nobody used")
            self._unstart(unit)
        assert not self._in_flight and not self._reading, "stage 3: gathers in flight for units that are not GATHERING"

    def start_micro_step(self) -> None:
        """The model's forward begins: a new micro-step in the recorded order (unless this is a forward
        inside a backward, e.g. activation checkpointing's recompute)."""
        if self.plan.recording_started and not in_backward():
            self.drop_prefetched()
            self.plan.new_micro_step()

    def end_micro_step(self) -> None:
        """After a backward: nothing prefetched stays, nor any secondary shard; the plan keeps or adopts the order."""
        self.drop_prefetched()
        if self.secondary is not None:
            self.secondary.drop_all()
        self.plan.end_micro_step()

    # ------------------------------------------------------------------------- forward hooks
    def after_root_forward(self, root: Unit) -> None:
        if not torch.is_grad_enabled():
            self.release(root)  # evaluation: nothing will come back for it

    def after_forward(self, unit: Unit, output: Any, last: bool = True) -> Any:
        """After a member's forward: release the unit unless it is kept (See [Note: prefetch]), and wrap
        its outputs so that their backward gathers it first."""
        # A merged unit stays for its next member's forward; an evaluation forward keeps nothing.
        if last and (not torch.is_grad_enabled() or not self.plan.keep_after_forward(unit.index, self.live())):
            self.release(unit)
        if not torch.is_grad_enabled() or not unit.trainable:
            return output
        flat, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not positions:
            return output
        wrapped = _GatherBeforeBackward.apply(self, unit, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)


class PendingRead(Protocol):
    def wait(self) -> Any: ...


StoredRead = tuple[torch.Tensor, PendingRead | None]
"""A group's stored values as the all-gather sends them, and the read filling them (None: ready)."""

GroupReads = list[tuple[ShardedGroup, StoredRead]]
"""A unit's groups, each with its StoredRead."""


def _on_disk(reads: GroupReads) -> bool:
    """Whether any of these values is still being read from disk."""
    return any(pending is not None for _, (_, pending) in reads)


def _wait(reads: GroupReads) -> None:
    """Wait for every read; the first error is raised after all have ended (none still fills memory)."""
    error: BaseException | None = None
    for _, (_, pending) in reads:
        if pending is not None:
            try:
                pending.wait()
            except BaseException as err:  # noqa: BLE001 (raised below, once every read has ended)
                error = error or err
    if error is not None:
        raise error


def _full(g: ShardedGroup) -> torch.Tensor:
    assert g.full is not None, f"stage-3 unit {g.unit_name!r} has no gathered buffer"
    return g.full


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit before its backward runs."""

    @staticmethod
    def forward(ctx: Any, gathers: UnitGathers, unit: Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.gathers, ctx.unit = gathers, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.gathers.grads_sent(ctx.unit):
            ctx.gathers.gather(ctx.unit)
        return (None, None, *grads)
