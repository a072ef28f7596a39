"""Stage 3's gradients: each unit's gradients collected into one bucket and reduce-scattered into the
fp32 shard gradients, unit by unit in one fixed order on every rank.

Each parameter's gradient is copied into its unit's gradient bucket (per trainable group, in the
wire dtype) as soon as autograd accumulated it, and freed, so no whole gradient outlives its unit's
backward. When all of a unit's gradients are in, the bucket is reduce-scattered into this rank's
fp32 shard gradient (shard_reduce: averaging, accumulation over micro-steps) and the unit released.
Units are reduced strictly in reverse forward order (the last block, whose backward ends first, goes
first, the root last): see [Note: launch order] in engine/zero/ordered_launch.py. At the end of
backward the rest are reduced in that order, complete or not (what is missing contributes zeros).
Each trainable group's gradients move through GradState (engine/zero/stage3/units.py): the one record
of whether its bucket is filling, in flight, or reduced into this window's shard gradient.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from engine.comm import ProcessGroup
from engine.offload.optimizer_swap import OptimizerSwap
from engine.ops.overflow import KnownSquares, chunk_sum_squares
from engine.precision import Precision
from engine.zero import shard_reduce
from engine.zero.ordered_launch import LaunchInOrder
from engine.zero.owners import grad_is_ready
from engine.zero.stage3.memory import Stage3Memory
from engine.zero.stage3.units import GradState, TrainableGroup, Unit

_FRESH_ALIGN = 64
"""Bytes torch's CPU allocator aligns a fresh tensor to: a slot (UnitGradients.slot) is lent only at such an
address, so the matrix product writing it sees its output placed as autograd's own would be (its kernel
may pick its path by the output's alignment; the results are meant to be bitwise the same)."""

MAX_REDUCES_IN_FLIGHT = 2
"""Gradient reduce-scatters (one per unit, optimizer group and dtype) in flight before the oldest is
waited for and its bucket recycled."""


class UnitGradients:
    """Gradient buckets of every unit and their reduction in the fixed unit order."""

    def __init__(
        self,
        units: Sequence[Unit],
        memory: Stage3Memory,
        precision: Precision,
        averaging: shard_reduce.Averaging,
        rank: int,
        *,
        release: Callable[[Unit], None],
        where: Callable[[], str],
        group: ProcessGroup | None = None,
        offload: OptimizerSwap | None = None,
        counted_pieces: Callable[[TrainableGroup, torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        self.units = units
        self._memory = memory
        self._precision = precision
        self._averaging = averaging
        self._rank = rank
        """Position in `group`, the data-parallel group gradients are reduced over (None: the world)."""
        self._group = group
        self._release = release
        """Release a unit whose gradients were sent (its parameters are not needed in this backward)."""
        self._offload = offload
        """The stage's NVMe swap, or None. With it, a reduction first waits for a step still reading the shard
        gradients (finish), and each shard gradient a reduction wrote leaves memory (release_grad)."""
        self._grads_on_disk = offload is not None and offload.settings.grads
        """The shard gradients are memory-mapped swap files: reduce in the bucket, store into them once, with
        O_DIRECT (store_grad), waited for at the end of the backward (wait_stored_grads)."""
        self._store = offload.store_grad if offload is not None else shard_reduce.store_nothing
        """row.copy_(values) by other means where it returns True (shard_reduce.finish: NVMe, O_DIRECT)."""
        self.window_ends = True
        """This backward ends the accumulation window (set by the stage): only its rows' partial sums are
        the ones the step adds, so earlier micro-steps take none (an added-to row would be read back)."""
        self._norm_pieces = counted_pieces if self._grads_on_disk else None
        """Given a group and its reduced values, the pieces the norm counts: where set (rows on NVMe), each
        group's partial sums are taken from its bucket as the reduction lands ([Note: the norm's partial
        sums] in engine/ops/overflow.py), so the step's norm reads no gradient back from disk."""
        self._where = where
        """Where training is (optimizer step, backward), for errors."""
        self._owner = {id(p): (u, g, i) for u in units for g in u.trainable for i, p in enumerate(g.params)}
        """id(parameter) -> its unit, group and index in the group."""
        self._order = LaunchInOrder(list(reversed(units)), complete=self._complete, launch=self._launch)
        """Units reduced in reverse forward order, the same on every rank."""
        self._position = {u.index: k for k, u in enumerate(reversed(units))}
        """Unit index -> its position in `_order`."""
        self._reducing: deque[TrainableGroup] = deque()
        """Groups whose reduce-scatter is in flight, oldest first."""
        self.in_place = 0
        """Gradients that arrived already in their bucket slot (computed there: slot()), over the stage's life."""

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: move it into its unit's bucket; reduce what is ready."""
        unit, g, i = self._owner[id(param)]
        grad = param.grad
        if grad is None or not grad_is_ready(param):  # more pieces to come (owners.grad_is_ready)
            return
        param.grad = None
        span = g.layout.params[i]
        into = self._bucket(unit, g, self._precision.wire_dtype(grad.dtype), grad.device)[span.offset : span.end]
        if i in g.arrived:
            into.add_(grad.reshape(-1))
        else:
            if not (grad.data_ptr() == into.data_ptr() and grad.is_contiguous() and grad.dtype == into.dtype):
                into.copy_(grad.reshape(-1))
            else:  # computed in its slot (slot()): already where it goes
                self.in_place += 1
            g.arrived.add(i)
        if self._complete(unit):
            self._order.launch_ready()

    def slot(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Where `param`'s gradient of this backward goes in its unit's bucket, shaped like the parameter, for
        the stage-3 linear to compute it into (memory_efficient_linear.py: no fresh gradient, no copy);
        None where it must come the usual way: a gradient of another dtype than the bucket's, one that
        arrived already (it is added), a unit already sent, a slot given before in this backward (a
        weight used twice: two products into one slot would leave only the last, and autograd adds the
        two it was given, which would both be that one), a parameter with tensor hooks (one may keep
        the gradient it is given, which must then not change when the bucket is reduced and reused), and
        a slot off the alignment of a fresh tensor (_FRESH_ALIGN)."""
        owner = self._owner.get(id(param))
        if owner is None:
            return None
        unit, g, i = owner
        if (
            i in g.arrived
            or i in g.slotted
            or self.sent(unit)
            or self._precision.wire_dtype(dtype) != dtype
            or param.device.type != "cpu"  # the arena and the measured page faults are the CPU's
            or param._backward_hooks
            or not grad_is_ready(param)  # accumulating in .grad over pieces (owners.grad_is_ready)
        ):
            return None
        span = g.layout.params[i]
        slot = self._bucket(unit, g, dtype, param.device)[span.offset : span.end].view(param.shape)
        if slot.data_ptr() % _FRESH_ALIGN:  # placed as a fresh gradient would be, so the product is the same
            return None
        g.slotted.add(i)
        return slot

    def _bucket(self, unit: Unit, g: TrainableGroup, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The group's bucket of this backward; the first ask takes one: EMPTY -> FILLING or REDUCED ->
        ACCUMULATING."""
        if not g.filling:
            g.grad_bucket = self._memory.bucket(g.layout.padded_numel, dtype, device, unit.name)
            g.move_grads(GradState.ACCUMULATING if g.grad_written else GradState.FILLING)
        assert g.grad_bucket is not None
        return g.grad_bucket

    def sent(self, unit: Unit) -> bool:
        """The unit's gradients of this backward were sent to be reduced (and the unit released): a
        later backward hook of its outputs must not gather it again. The launch order is the one
        record of it; it restarts at the end of every backward (flush)."""
        return self._order.launched(self._position[unit.index])

    def _complete(self, unit: Unit) -> bool:
        return all(len(g.arrived) == len(g.params) for g in unit.trainable)

    def _launch(self, unit: Unit) -> None:
        """Start reduce-scattering the unit's buckets, then release the unit."""
        if self._offload is not None:
            self._offload.finish()
        for g in unit.trainable:
            bucket = g.grad_bucket
            if not g.filling:  # no gradient on this rank: contribute zeros
                bucket = self._memory.bucket(
                    g.layout.padded_numel, self._precision.wire_dtype(g.dtype), g.device, unit.name
                ).zero_()
                g.grad_bucket = bucket
            else:  # a pooled buffer: whatever no gradient was written to must be zero (padding included)
                assert bucket is not None
                for i, span in enumerate(g.layout.params):
                    if i not in g.arrived:
                        bucket[span.offset : span.end].zero_()
                bucket[g.layout.numel :].zero_()
            written = g.grad_written
            g.pending = shard_reduce.start(
                bucket,
                g.shard_grad,
                written=written,
                in_bucket=self._grads_on_disk,
                rank=self._rank,
                averaging=self._averaging,
                key=unit.index,
                group=self._group,
            )
            g.move_grads(GradState.ADDING if written else GradState.REDUCING)
            self._reducing.append(g)
        self._release(unit)
        # At most MAX_REDUCES_IN_FLIGHT groups' buckets stay alive: the rest of the backward overlaps
        # them, and the bucket memory is a few units', not the model's.
        while len(self._reducing) > MAX_REDUCES_IN_FLIGHT:
            self._finish(self._reducing.popleft())

    def _finish(self, g: TrainableGroup) -> None:
        """Wait for the group's reduce-scatter and recycle its bucket: REDUCING/ADDING -> REDUCED."""
        if not g.in_flight:
            return
        assert g.pending is not None
        adding = g.grad_state is GradState.ADDING
        shard_reduce.finish(
            g.pending,
            g.shard_grad,
            written=adding,
            what=f"reduce-scatter of stage-3 unit {g.unit_name!r} gradients ({self._where()})",
            store=self._store,
        )
        g.norm_squares = None
        if self._norm_pieces is not None and self.window_ends:  # the row's values: in the bucket if overwritten
            out = g.pending.out
            values = g.shard_grad if adding or out is None else out.view(g.shard_grad.shape)
            g.norm_squares = KnownSquares(*chunk_sum_squares(self._norm_pieces(g, values)))
        g.pending = None
        g.arrived.clear()
        g.slotted.clear()
        self._recycle_bucket(g)
        g.move_grads(GradState.REDUCED)
        if self._offload is not None:
            self._offload.release_grad(g.shard_grad)  # its pages leave memory (its values are in its file)

    def _recycle_bucket(self, g: TrainableGroup) -> None:
        if g.grad_bucket is not None:
            self._memory.release_bucket(g.grad_bucket)
            g.grad_bucket = None

    def _pending(self) -> bool:
        return any(g.filling for u in self.units for g in u.trainable)

    def flush(self) -> None:
        """End of a backward (or a step): reduce every unit not reduced yet in this backward, wait for
        all (and for their stores to disk, where the shard gradients are), release every unit."""
        if self._order.started or self._pending():
            self._order.launch_rest()
        for unit in self.units:
            for g in unit.trainable:
                self._finish(g)
            self._release(unit)
        self._reducing.clear()
        self._order.restart()
        if self._offload is not None:
            self._offload.wait_stored_grads()

    def shard_grads(self) -> list[torch.Tensor]:
        """Every fp32 shard gradient, in the order the optimizer's masters were bound."""
        return [g.shard_grad for u in self.units for g in u.trainable]

    def stale_rows(self) -> list[torch.Tensor]:
        """Shard gradients no reduction wrote in this accumulation window (zeroed before the step)."""
        return [g.shard_grad for u in self.units for g in u.trainable if not g.grad_written]

    def zero_grad(self) -> None:
        """A new accumulation window: nothing in flight, no bucket held, no gradient written (EMPTY)."""
        for u in self.units:
            for g in u.trainable:
                if g.pending is not None:
                    g.pending.work.wait()
                    g.pending = None
                self._recycle_bucket(g)
                g.arrived.clear()
                g.slotted.clear()
                g.norm_squares = None
                g.move_grads(GradState.EMPTY)
                for p in g.params:
                    p.grad = None
        self._reducing.clear()
        self._order.restart()

    def clear(self) -> None:
        self._owner.clear()
