"""What ZeRO stages 1 and 2 share: flat groups, ordered bucket reduction into fp32 gradient shards,
the optimizer step on shards, and the all-gather of updated parameters.

Subclasses decide only where a bucket's gradient comes from (stage 1: a full-size flat gradient
buffer, reduced at the accumulation boundary; stage 2: bucket-sized buffers filled by hooks and
reduced every micro-step). Stage 0 in mixed precision is this class with one partition (the
"reduce-scatter" is an all-reduce and nothing is gathered).

# [Note: bucket launch order, again]
# As at stage 0, collectives must be issued in the same order on every rank. Buckets of all
# groups get one global order, by the arrival position of the last parameter they hold (so the
# first complete buckets go first), and are launched strictly in that order.
#
# [Note: late gradients]
# A parameter's gradient can be accumulated twice in one backward (a reentrant activation
# checkpoint; a module run inside and outside a checkpointed region). If its bucket was already
# sent, the late part goes into a per-bucket side buffer. At step() all ranks agree, with one
# tiny all-reduce, on which buckets have late parts anywhere, and reduce exactly those, so no
# rank can issue a collective the others do not. (DeepSpeed asserts "gradient computed twice".)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import comm
from engine.checkpoint.records import ShardRecord, layout_pieces
from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.precision import Precision
from engine.zero import bucket_sizes, owners, shard_reduce
from engine.zero.base import StepOutcome
from engine.zero.flat_groups import FlatGroup, arrival_order, build_flat_groups, check_elementwise
from engine.zero.offload import OffloadTarget, OptimizerOffload, offload_enabled

logger = get_logger()


@dataclass
class Bucket:
    """One bucket of one flat group, in the global launch order."""

    order: int
    group: FlatGroup
    b: int
    params: list[int]
    """Indices (in the group) of the parameters with elements in this bucket."""
    ready: set[int] = field(default_factory=set)
    """Parameters whose gradient for this reduction has been written into `data`."""
    launched: bool = False
    pending: shard_reduce.PendingReduce | None = None
    """The reduction in flight, waited for in _finish."""
    data: torch.Tensor | None = None
    """The bucket_numel elements being reduced (wire dtype)."""
    pooled: bool = False
    """`data` came from the bucket pool and goes back to it when the reduction finishes."""

    def portion(self, i: int) -> tuple[slice, slice]:
        """(range in the bucket, range in the flattened parameter) of parameter i's elements here."""
        span = self.group.layout.params[i]
        start, end = self.group.layout.bucket_range(self.b)
        lo, hi = max(start, span.offset), min(end, span.end)
        return slice(lo - start, hi - start), slice(lo - span.offset, hi - span.offset)


class BucketPool:
    """Reusable bucket buffers, allocated once (fresh memory costs first-touch page faults).

    Every buffer of a dtype has the size of the largest bucket (`capacity`), so buckets of
    different groups share them and the pool's memory is set by the config, not by the model.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> full buffer handed out
        self.allocated_bytes = 0

    @property
    def in_use(self) -> int:
        return len(self._lent)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.setdefault((dtype, device), [])
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]  # larger requests get their own size
        if fitting:
            buf = free.pop(min(fitting, key=lambda i: free[i].numel()))
        else:
            buf = torch.empty(max(numel, self.capacity), dtype=dtype, device=device)
            self.allocated_bytes += buf.numel() * buf.element_size()
        self._lent[buf.data_ptr()] = buf
        return buf[:numel]

    def release(self, view: torch.Tensor) -> None:
        buf = self._lent.pop(view.data_ptr())
        self._free.setdefault((buf.dtype, buf.device), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
        self.allocated_bytes = 0


class PartitionedStage:
    """Base of the flat, sharded-optimizer stages. See the module docstring."""

    stage = 1

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: EngineConfig,
                 precision: Precision, *, partitioned: bool = True) -> None:
        if optimizer is None:
            raise ValueError(f"zero_optimization.stage {self.stage} needs an optimizer: add an \"optimizer\" "
                             "section to the config or pass optimizer= to engine.initialize()")
        check_elementwise(optimizer, self.stage, config.zero_allow_untested_optimizer)
        self.optimizer = optimizer
        self.precision = precision
        self.partitioned = partitioned
        self._world = comm.get_world_size()
        self._rank = comm.get_rank() if partitioned else 0
        zero = config.zero
        self._averaging = shard_reduce.Averaging.from_config(config, comm.get_world_size())
        self._use_reduce_scatter = zero.reduce_scatter
        self._allgather_partitions = zero.allgather_partitions
        wire_size = max((precision.wire_dtype(p.dtype).itemsize for p in module.parameters()), default=4)
        reduce_size, self._allgather_limit = bucket_sizes.resolve(zero, wire_size)
        self.groups: list[FlatGroup] = build_flat_groups(
            module, optimizer, world_size=self._world if partitioned else 1, rank=self._rank,
            bucket_size=reduce_size)

        order = arrival_order(module)
        buckets: list[tuple[int, int, int, list[int]]] = []
        for g in self.groups:
            for b in range(g.layout.num_buckets):
                members = [i for i in g.layout.params_in(b) if g.layout.params[i].numel]  # 0-element: no data
                last = max((order[id(g.params[i])] for i in members), default=-1)
                buckets.append((last, g.index, b, members))
        buckets.sort(key=lambda t: (t[0], t[1], t[2]))
        self.buckets = [Bucket(n, self.groups[gi], b, members) for n, (_, gi, b, members) in enumerate(buckets)]
        self._bucket = {(bk.group.index, bk.b): bk for bk in self.buckets}
        self._where = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        for g in self.groups:
            for p in g.params:
                owners.set_masters(p, self)  # GatheredParameters(modifier_rank=...) refreshes masters through it
        self._next_launch = 0
        self._reduce_in_backward = False
        self._late: dict[int, torch.Tensor] = {}  # bucket order -> late gradient parts; see the Note
        self.pool = BucketPool(max(g.layout.bucket_numel for g in self.groups) if self.groups else 0)
        self.launched_from_hooks = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in self.groups for p in g.params]
        # Optimizer offload: one fused pass also writes the low-precision shard (no refresh_params).
        self._offload = OptimizerOffload(optimizer, [
            OffloadTarget(g.master, g.shard_view(g.flat) if g.owns_master else None) for g in self.groups
        ]) if offload_enabled(config) else None

    # ------------------------------------------------------------------- subclass interface
    def _on_grad(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _fill(self, bk: Bucket) -> None:
        """Make bk.data hold the bucket's complete local gradient (called right before launch)."""
        raise NotImplementedError

    def _has_unreduced(self) -> bool:
        """Local gradients exist that no reduction has consumed yet (no_sync, or no boundary backward)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------- reduction
    def wire_dtype(self, g: FlatGroup) -> torch.dtype:
        return self.precision.wire_dtype(g.dtype)

    def _mark_ready(self, bk: Bucket, i: int) -> None:
        bk.ready.add(i)
        if len(bk.ready) == len(bk.params) and self._reduce_in_backward:
            before = self._next_launch
            self._launch_in_order(complete_only=True)
            self.launched_from_hooks += self._next_launch - before

    def _launch_in_order(self, *, complete_only: bool) -> None:
        while self._next_launch < len(self.buckets):
            bk = self.buckets[self._next_launch]
            if complete_only and len(bk.ready) < len(bk.params):
                return
            self._launch(bk)

    def _launch(self, bk: Bucket) -> None:
        self._fill(bk)
        self._start_reduction(bk)
        bk.launched = True
        self._next_launch = bk.order + 1

    def _start_reduction(self, bk: Bucket) -> None:
        assert bk.data is not None
        g = bk.group
        bk.pending = shard_reduce.start(
            bk.data, g.shard_grad[bk.b], written=g.grad_written[bk.b], rank=self._rank, averaging=self._averaging,
            scatter=self.partitioned and self._use_reduce_scatter, key=bk.order)

    def _finish(self, bk: Bucket) -> None:
        if bk.pending is None:
            return
        g = bk.group
        shard_reduce.finish(bk.pending, g.shard_grad[bk.b], written=g.grad_written[bk.b],
                            what=f"gradient reduction of bucket {bk.order} (group {g.index}, bucket {bk.b})")
        bk.pending = None
        g.grad_written[bk.b] = True
        if bk.pooled:
            self.pool.release(bk.data)
            bk.data, bk.pooled = None, False

    def _finish_all(self) -> None:
        for bk in self.buckets:
            self._finish(bk)

    def _reset_reduction(self) -> None:
        """Ready for the next reduction round (the next backward, or the next window)."""
        self._finish_all()
        for bk in self.buckets:
            bk.ready.clear()
            bk.launched = False
        self._next_launch = 0

    def _add_late(self, bk: Bucket, i: int, grad: torch.Tensor) -> None:
        buf = self._late.get(bk.order)
        if buf is None:
            buf = self._late[bk.order] = torch.zeros(bk.group.layout.bucket_numel, dtype=self.wire_dtype(bk.group),
                                                     device=grad.device)
        in_bucket, in_param = bk.portion(i)
        buf[in_bucket].add_(grad.reshape(-1)[in_param])

    def _reduce_late(self) -> None:
        """Reduce late gradient parts; every rank takes part for a bucket any rank has. See the Note."""
        if self._world == 1 and not self._late:
            return
        flags = torch.zeros(len(self.buckets), dtype=torch.float32)
        for order in self._late:
            flags[order] = 1.0
        if self._world > 1:
            comm.all_reduce(flags, op=comm.ReduceOp.MAX)
        for order in torch.nonzero(flags).flatten().tolist():
            bk = self.buckets[order]
            late = self._late.pop(order, None)
            if late is None:
                late = torch.zeros(bk.group.layout.bucket_numel, dtype=self.wire_dtype(bk.group),
                                   device=bk.group.flat.device)
            bk.data, bk.pooled = late, False
            self._start_reduction(bk)
            self._finish(bk)
            bk.data = None
        self._late.clear()

    # ------------------------------------------------------------------------ stage interface
    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        raise NotImplementedError

    def finish_backward(self) -> None:
        if self._reduce_in_backward:
            self._launch_in_order(complete_only=False)
            self._reset_reduction()
        self._reduce_in_backward = False

    def _flush(self) -> None:
        """Before a step: reduce whatever local gradient no backward has reduced yet."""
        if self._has_unreduced():
            self._reduce_in_backward = True
            self.finish_backward()
        self._finish_all()
        self._reduce_late()

    def step(self, max_grad_norm: float) -> StepOutcome:
        self._flush()
        for g in self.groups:
            for b, written in enumerate(g.grad_written):
                if not written:  # no gradient reached this bucket in the whole window
                    g.shard_grad[b].zero_()
        average = self._averaging.after
        norm, applied = self.precision.step_shards([g.shard_grad for g in self.groups], self.optimizer,
                                                   max_grad_norm=max_grad_norm, average=average,
                                                   partitioned=self.partitioned,
                                                   fused_step=self._offload.step if self._offload else None)
        if not applied:
            self.zero_grad()
            return StepOutcome(norm, applied=False)
        if self._offload is None:
            for g in self.groups:
                g.refresh_params()
        self._gather_params()
        self.zero_grad()
        return StepOutcome(norm, applied=True)

    def checkpoint_shards(self) -> list[ShardRecord]:
        """Each flat group's fp32 master shard; unpartitioned (stage 0 in bf16/fp16): rank 0 writes."""
        write = self.partitioned or comm.get_rank() == 0
        return [ShardRecord(g.master, layout_pieces(g.layout, g.rank, g.names), g.opt_group, write)
                for g in self.groups]

    def refresh_masters(self) -> None:
        """Parameters were changed by the user (the same on every rank): copy them into the fp32 masters."""
        for g in self.groups:
            if g.owns_master:
                g.master.copy_(g.shard_view(g.flat))

    def _gather_params(self) -> None:
        """All-gather every bucket's updated slices in place into the flat parameter buffers."""
        if not self.partitioned or self._world == 1:
            return
        in_flight: list[comm.Handle] = []
        in_flight_numel = 0
        for bk in self.buckets:
            g, lay = bk.group, bk.group.layout
            full = g.bucket(g.flat, bk.b)
            if self._allgather_partitions:
                mine = full[self._rank * lay.slice_numel:(self._rank + 1) * lay.slice_numel]
                in_flight.append(comm.all_gather(full, mine, async_op=True))
            else:  # DeepSpeed's allgather_partitions=false: one broadcast per owner
                for r in range(self._world):
                    in_flight.append(comm.broadcast(full[r * lay.slice_numel:(r + 1) * lay.slice_numel], src=r,
                                                    async_op=True))
            in_flight_numel += lay.bucket_numel
            if in_flight_numel >= self._allgather_limit:  # allgather_bucket_size bounds what is in flight
                for work in in_flight:
                    work.wait()
                in_flight, in_flight_numel = [], 0
        for work in in_flight:
            work.wait()

    def zero_grad(self) -> None:
        self._reset_reduction()
        self._late.clear()
        for g in self.groups:
            g.grad_written = [False] * g.layout.num_buckets
            for p in g.params:
                p.grad = None

    # ------------------------------------------------------------------------------ reports
    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank per model-state category; views count once, with their storage."""
        seen: set[int] = set()

        def nbytes(tensors: list[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        state = [v for g in self.groups for v in self.optimizer.state.get(g.master, {}).values()
                 if torch.is_tensor(v) and v.numel() > 1]
        return {
            "params": nbytes([g.flat for g in self.groups]),
            "master": nbytes([g.master for g in self.groups]),
            "gradients": nbytes(self._gradient_buffers() + [g.shard_grad for g in self.groups]),
            "optimizer_state": nbytes(state),
            "buckets": self.pool.allocated_bytes,
        }

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> dict[str, object]:
        return {}

    def destroy(self) -> None:
        self._reset_reduction()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for g in self.groups:
            for p in g.params:
                p.grad = None
                if owners.masters_of(p) is self:
                    owners.set_masters(p, None)
            g.master.grad = None
        self.buckets.clear()
        self._bucket.clear()
        self._where.clear()
        self._late.clear()
        self.pool.clear()
        comm.free_buffers()
