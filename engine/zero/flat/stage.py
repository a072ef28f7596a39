"""What ZeRO stages 0, 1 and 2 share: flat groups, ordered bucket reduction into gradient rows (in the
accumulation dtype), the optimizer step on them, and (when partitioned) the all-gather of updated
parameters.

Every trainable parameter lives in a flat group (engine/zero/flat_groups.py) laid out by
engine/zero/layout.py with `shards` slices per bucket: the world size at stages 1-2, one at stage 0,
where every rank keeps every slice. So one mechanism covers all three stages, and what differs
follows from the data: a bucket of several slices is reduce-scattered and gathered back after the
step; a bucket of one slice is all-reduced and nothing is gathered.

Subclasses decide where a bucket's gradient comes from (engine/zero/flat/boundary_reduced.py, stages 0
and 1: a full-size flat gradient buffer, reduced at the accumulation boundary; stage 2: bucket-sized
buffers filled by hooks and reduced every micro-step) and how the optimizer sees the fp32 masters
(stages 1-2: one flat shard per group; stage 0: one view per parameter, so per-tensor optimizers
such as LAMB keep their meaning).

Buckets of all groups get one global launch order, by the arrival position of the last parameter
they hold (so the first complete buckets go first); see [Note: launch order] in ordered_launch.py.

# [Note: late gradients]
# A parameter's gradient can be accumulated twice in one backward (a reentrant activation
# checkpoint; a module run inside and outside a checkpointed region). If its bucket was already
# sent, the late part goes into a per-bucket side buffer. At step() all ranks agree, with one
# tiny all-reduce, on which buckets have late parts anywhere, and reduce exactly those, so no
# rank can issue a collective the others do not. (DeepSpeed asserts "gradient computed twice".)
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine import comm
from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.offload.optimizer_swap import OptimizerSwap
from engine.parallel.groups import ParallelGroups
from engine.precision import Precision
from engine.zero import fragments, owners, shard_reduce, shard_step
from engine.zero.base import StepOutcome
from engine.zero.bucket_pool import BucketPool
from engine.zero.flat import bucket_sizes, holdings
from engine.zero.flat.bucket import REDUCTION_MOVES, Bucket, Reduction
from engine.zero.flat.unused import UnusedCheck
from engine.zero.flat_groups import FlatGroup, arrival_order, bind_optimizer_to_shards, build_flat_groups
from engine.zero.master_step import MasterStep
from engine.zero.norm_scope import NormScope, counted_rows, counted_runs
from engine.zero.offload_states import OffloadStateTypeEnum
from engine.zero.ordered_launch import LaunchInOrder
from engine.zero.records import ShardRecord, layout_pieces
from engine.zero.state_moves import check_move
from engine.zero.tp_state import whole_state_dict

logger = get_logger()


class FlatStage:
    """Base of the flat stages 0-2. See the module docstring."""

    stage: int
    partitioned: ClassVar[bool]
    """Each rank owns one slice of every bucket (stages 1-2), or keeps the whole of it (stage 0). Read
    here only, to lay the groups out and to choose reduce-scatter or all-reduce."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: EngineConfig,
        precision: Precision,
        parallel: ParallelGroups | None = None,
    ) -> None:
        self.optimizer = optimizer  # never None: the flat stages always train
        self.precision = precision
        self.module = module
        self.parallel = parallel or ParallelGroups.data_parallel_only()
        """ZeRO partitions and reduces over the data-parallel group (the world without tensor parallelism)."""
        self._group = self.parallel.dp_group
        shards = self.parallel.dp_size if self.partitioned else 1
        self._shards = shards
        """Slices per bucket."""
        self._rank = self.parallel.dp_rank if self.partitioned else 0
        zero = config.zero
        self._averaging = shard_reduce.Averaging.from_config(config, self.parallel.dp_size)
        self._scatter = self.partitioned and zero.reduce_scatter
        self._allgather_partitions = zero.allgather_partitions
        wire_size = max((precision.wire_dtype(p.dtype).itemsize for p in module.parameters()), default=4)
        reduce_size, self._allgather_limit = bucket_sizes.resolve(
            zero, wire_size, self.parallel.dp_size, gathers=self.partitioned
        )
        self.groups: list[FlatGroup] = build_flat_groups(
            module, optimizer, world_size=shards, rank=self._rank, bucket_size=reduce_size
        )
        self._allocate_gradients()
        self._bind_optimizer(config)
        self.offload: OptimizerSwap | None = self.master_step.swap
        """The NVMe swap of the optimizer state and masters (engine/offload/), or None."""
        self._norm_scope = NormScope.of(self.parallel, partitioned=shards > 1)
        self._norm_runs = [counted_runs(g.layout, g.rank, g.params, self.parallel) for g in self.groups]
        """Per group, the runs of its gradient shard this rank counts in the global norm (norm_scope.py)."""

        order = arrival_order(module)
        keyed: list[tuple[int, int, int, list[int]]] = []
        for g in self.groups:
            for b in range(g.layout.num_buckets):
                members = [i for i in g.layout.params_in(b) if g.layout.params[i].numel]  # 0-element: no data
                last = max((order[id(g.params[i])] for i in members), default=-1)
                keyed.append((last, g.index, b, members))
        keyed.sort(key=lambda t: (t[0], t[1], t[2]))
        self.buckets = [Bucket(n, self.groups[gi], b, members) for n, (_, gi, b, members) in enumerate(keyed)]
        self._bucket = {(bk.group.index, bk.b): bk for bk in self.buckets}
        self._launcher = LaunchInOrder(self.buckets, complete=lambda bk: bk.complete, launch=self._launch)
        self._where = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        self._register_owners()
        self.reduction = Reduction.IDLE
        """What the running backward does with its gradients (see Reduction)."""
        self._late: dict[int, torch.Tensor] = {}  # bucket order -> late gradient parts; see the Note
        self.pool = BucketPool(max(g.layout.bucket_numel for g in self.groups) if self.groups else 0)
        self._max_buffers = 2 if zero.overlap_comm else 1
        """Pooled bucket buffers in flight before the oldest reduction is waited for."""
        self._grew = False
        self.launched_from_hooks = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in self.groups for p in g.params]
        named = [(name, p) for g in self.groups for name, p in zip(g.names, g.params)]
        self._unused = UnusedCheck(named, self._group, enabled=self.partitioned and not zero.ignore_unused_parameters)

    def _register_owners(self) -> None:
        """The masters for GatheredParameters; the HeldState for the tensor-fragment API (zero/fragments.py)."""
        fragments.HeldState(
            self._held_groups(),
            stage=self.stage,
            optimizer=self.optimizer,
            group=self._group,
            replicated=not self.partitioned,
            averaging=self._averaging,
            precision=self.precision,
            offload=self.offload,
        ).register()
        for g in self.groups:
            for p in g.params:
                owners.set_masters(p, self)

    def _held_groups(self) -> list[fragments.HeldGroup]:
        return [g.held() for g in self.groups]  # stage 0's: one per parameter, as its optimizer steps them

    # ------------------------------------------------------------------- subclass interface
    def _allocate_gradients(self) -> None:
        """The gradient buffers, and each group's gradient rows (shard_grad) in the accumulation dtype:
        a buffer of their own, or views of a full-size one. Called once, from __init__ (before the
        hooks exist); a subclass sets up its own gradient bookkeeping here, so it needs no __init__."""
        raise NotImplementedError

    def _bind_optimizer(self, config: EngineConfig) -> None:
        """Point the optimizer at the fp32 masters and set up the step over them and their gradient rows
        (self.master_step): one shard per group (stages 1-2; stage 0 binds one view per parameter)."""
        self.master_step: MasterStep = bind_optimizer_to_shards(self.optimizer, self.groups, config)

    def _on_grad(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _fill(self, bk: Bucket) -> None:
        """Make bk.data hold the bucket's complete local gradient (called right before launch)."""
        raise NotImplementedError

    def _has_unreduced(self) -> bool:
        """Local gradients exist that no reduction has consumed yet (no_sync, or no boundary backward)."""
        raise NotImplementedError

    def _gradient_buffers(self) -> list[torch.Tensor]:
        """Gradient memory beyond the fp32 rows, for memory_report."""
        raise NotImplementedError

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------------------- reduction
    def wire_dtype(self, g: FlatGroup) -> torch.dtype:
        return self.precision.wire_dtype(g.dtype)

    def _acquire(self, bk: Bucket) -> torch.Tensor:
        """The bucket's buffer (wire dtype), taking one from the pool; waits for the oldest in-flight
        reduction when the pool is at its limit (overlap_comm: 2, else 1), so bucket memory stays
        constant whatever the model's size."""
        if bk.data is not None:
            return bk.data
        while self.pool.in_use >= self._max_buffers:
            in_flight = next((x for x in self.buckets[: self._launcher.next] if x.pending is not None), None)
            if in_flight is None:
                if not self._grew:
                    logger.debug(
                        "stage %d: gradients arrive out of bucket order; bucket pool grows beyond %d",
                        self.stage,
                        self._max_buffers,
                    )
                    self._grew = True
                break
            self._wait_reduction(in_flight)
        g = bk.group
        bk.data = self.pool.acquire(g.layout.bucket_numel, self.wire_dtype(g), g.flat.device)
        bk.pooled = True
        return bk.data

    def _mark_ready(self, bk: Bucket, i: int) -> None:
        bk.ready.add(i)
        if bk.complete and self.reduction is Reduction.REDUCING:
            self.launched_from_hooks += self._launcher.launch_ready()

    def _launch(self, bk: Bucket) -> None:
        self._fill(bk)
        self._start_reduction(bk)

    def _start_reduction(self, bk: Bucket) -> None:
        assert bk.data is not None
        g = bk.group
        start, end = g.layout.bucket_range(bk.b)
        bk.pending = shard_reduce.start(
            bk.data,
            g.shard_grad[bk.b],
            written=g.grad_written[bk.b],
            rank=self._rank,
            averaging=self._averaging,
            scatter=self._scatter,
            key=bk.order,
            real=min(end, g.layout.numel) - start,
            group=self._group,
        )

    def _wait_reduction(self, bk: Bucket) -> None:
        """Wait for bk's reduction, if one is in flight, and give its pooled buffer back."""
        if bk.pending is None:
            return
        g = bk.group
        shard_reduce.finish(
            bk.pending,
            g.shard_grad[bk.b],
            written=g.grad_written[bk.b],
            what=f"gradient reduction of bucket {bk.order} (group {g.index}, bucket {bk.b})",
        )
        bk.pending = None
        g.grad_written[bk.b] = True
        if bk.pooled:
            assert bk.data is not None
            self.pool.release(bk.data)
            bk.data, bk.pooled = None, False

    def _wait_reductions(self) -> None:
        for bk in self.buckets:
            self._wait_reduction(bk)

    def _end_round(self) -> None:
        """Every reduction of this round waited for; ready for the next backward, or the next window."""
        self._wait_reductions()
        for bk in self.buckets:
            bk.ready.clear()
        self._launcher.restart()

    def _add_late(self, bk: Bucket, i: int, grad: torch.Tensor) -> None:
        """A gradient of parameter i arrived after bucket bk was sent (see the Note)."""
        buf = self._late.get(bk.order)
        if buf is None:
            buf = self._late[bk.order] = torch.zeros(
                bk.group.layout.bucket_numel, dtype=self.wire_dtype(bk.group), device=grad.device
            )
        in_bucket, in_param = bk.portion(i)
        buf[in_bucket].add_(grad.reshape(-1)[in_param])

    def _reduce_late(self) -> None:
        """Reduce late gradient parts; every rank takes part for a bucket any rank has. See the Note."""
        world = self.parallel.dp_size
        if world == 1 and not self._late:
            return
        flags = torch.zeros(len(self.buckets), dtype=torch.float32)
        for order in self._late:
            flags[order] = 1.0
        if world > 1:
            comm.all_reduce(flags, op=comm.ReduceOp.MAX, group=self._group)
        for order in torch.nonzero(flags).flatten().tolist():
            bk = self.buckets[order]
            late = self._late.pop(order, None)
            if late is None:
                late = torch.zeros(
                    bk.group.layout.bucket_numel, dtype=self.wire_dtype(bk.group), device=bk.group.flat.device
                )
            bk.data, bk.pooled = late, False
            self._start_reduction(bk)
            self._wait_reduction(bk)
            bk.data = None
        self._late.clear()

    # ------------------------------------------------------------------------ stage interface
    def _begin_backward(self, reducing: bool) -> None:
        """prepare_backward's move: this backward reduces its buckets as they complete, or keeps its
        gradients local."""
        self.move_reduction(Reduction.REDUCING if reducing else Reduction.LOCAL)

    def finish_backward(self) -> None:
        if self.reduction is Reduction.REDUCING:
            self._launcher.launch_rest()
            self._end_round()
            self._consumed_local()
        if self.reduction is not Reduction.IDLE:
            self.move_reduction(Reduction.IDLE)

    def _consumed_local(self) -> None:
        """A reduction round ended that took in every local gradient kept so far (no_sync's, or the
        non-boundary micro-steps'): a subclass drops what held them."""

    def _reduce_leftovers(self) -> None:
        """Before a step: reduce whatever local gradient no backward has reduced yet, wait for every
        reduction, reduce the late gradient parts."""
        if self._has_unreduced():
            self.move_reduction(Reduction.REDUCING)
            self.finish_backward()
        self._wait_reductions()
        self._reduce_late()

    def move_reduction(self, to: Reduction) -> None:
        """Take a transition of REDUCTION_MOVES (engine/zero/flat/bucket.py); anything else is a bug, refused."""
        check_move(f"stage {self.stage}: the gradient reduction", self.reduction, to, REDUCTION_MOVES)
        self.reduction = to

    def step(self, max_grad_norm: float) -> StepOutcome:
        self._reduce_leftovers()
        self._unused.check()
        stale = [g.shard_grad[b] for g in self.groups for b, written in enumerate(g.grad_written) if not written]
        outcome = shard_step.step_on_gradients(
            self.precision,
            self._norm_rows,
            stale=stale,
            averaging=self._averaging,
            max_grad_norm=max_grad_norm,
            scope=self._norm_scope,
            update=self.master_step.step,
        )
        if outcome.applied:
            self._gather_params()
        self.zero_grad()
        return outcome

    def _norm_rows(self) -> list[torch.Tensor]:
        return [
            row
            for g, runs in zip(self.groups, self._norm_runs)
            for row in counted_rows(g.shard_grad, runs, g.layout.slice_numel)
        ]

    def refresh_masters(self) -> None:
        """Parameters were changed by the user (the same on every rank): copy them into the fp32 masters."""
        for g in self.groups:
            if g.owns_master:
                g.master.copy_(g.shard_view(g.flat))

    def _gather_params(self) -> None:
        """All-gather every bucket's updated slices in place into the flat parameter buffers."""
        if self._shards == 1:
            return  # every rank updated every slice
        in_flight: list[comm.Handle] = []
        in_flight_numel = 0
        for bk in self.buckets:
            g, lay = bk.group, bk.group.layout
            full = g.bucket(g.flat, bk.b)
            if self._allgather_partitions:
                mine = full[self._rank * lay.slice_numel : (self._rank + 1) * lay.slice_numel]
                in_flight.append(comm.all_gather(full, mine, async_op=True, group=self._group))
            else:  # DeepSpeed's allgather_partitions=false: one broadcast per owner
                for r in range(self._shards):
                    in_flight.append(
                        comm.broadcast(
                            full[r * lay.slice_numel : (r + 1) * lay.slice_numel],
                            src=self.parallel.dp_src(r),
                            async_op=True,
                            group=self._group,
                        )
                    )
            in_flight_numel += lay.bucket_numel
            if in_flight_numel >= self._allgather_limit:  # allgather_bucket_size bounds what is in flight
                for work in in_flight:
                    work.wait()
                in_flight, in_flight_numel = [], 0
        for work in in_flight:
            work.wait()

    def zero_grad(self) -> None:
        self._end_round()
        self.reduction = Reduction.IDLE  # from any state: a backward that raised is abandoned with its gradients
        self._late.clear()
        self._unused.clear()
        for g in self.groups:
            g.grad_written = [False] * g.layout.num_buckets
            for p in g.params:
                p.grad = None

    def checkpoint_shards(self) -> list[ShardRecord]:
        """Each flat group's fp32 master shard (every rank writes its own)."""
        return [ShardRecord(g.master, layout_pieces(g.layout, g.rank, g.names), g.opt_group, True) for g in self.groups]

    def consolidated_state_dict(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        """Every rank holds whole parameters (its tensor-parallel slices of them): rank 0 copies the
        module's state dict, tensor-parallel slices joined."""
        return whole_state_dict(self.module.state_dict(keep_vars=True), self.parallel, device)

    # ------------------------------------------------------------------------------ reports
    def resident_states(self) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
        return holdings.resident_states(self.groups, self.optimizer, self._gradient_buffers())

    def release_scratch(self) -> None:
        if not self.pool.in_use:
            self.pool.clear()

    def memory_report(self) -> dict[str, int]:
        return {
            **holdings.held_bytes(self.resident_states()),
            "buckets": self.pool.allocated_bytes,
            **({"nvme": self.offload.disk_bytes()} if self.offload is not None else {}),
        }

    def destroy(self) -> None:
        if self.offload is not None:
            self.offload.finish()
        self._end_round()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._unused.remove()
        for g in self.groups:
            for p in g.params:
                p.grad = None
                if owners.masters_of(p) is self:
                    owners.set_masters(p, None)
                    owners.set_held(p, None)
            g.master.grad = None
        self.buckets.clear()
        self._bucket.clear()
        self._where.clear()
        self._late.clear()
        self.pool.clear()
        comm.free_buffers()
        if self.offload is not None:
            self.offload.close()  # the swap files and folder removed
