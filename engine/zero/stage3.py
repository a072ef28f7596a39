"""Stage 3: parameters, gradients and optimizer state partitioned; full parameters exist only while
the unit that owns them computes (paper 5.3, 7.2.2).

Each gather unit (engine/zero/units.py) keeps, per optimizer param group and dtype, one group in the
shared flat layout with a single bucket: rank r stores slice r (its *shard*, which in fp32 is also
the optimizer's master), one all-gather fetches the whole unit and one reduce-scatter returns its
gradients. Lifecycle of a unit in a step:

    forward pre-hook   gather (all-gather into a fresh full buffer; params' .data become views)
    forward post-hook  release (params' .data become empty) and wrap the outputs so that
    backward           the unit is gathered again right before its backward runs
    grad hooks         each gradient is copied into the unit's gradient bucket and freed; when all
                       of the unit's gradients are in, the bucket is reduce-scattered into the fp32
                       shard gradient (in a fixed unit order on every rank) and the unit released

The root unit (parameters outside the repeated blocks: embeddings, final norm, a tied head) is
gathered when the model's forward starts and stays gathered until its gradients are reduced.

# [Note: prefetch]
# Every real gather of a micro-step (forward and backward) is recorded. From the next micro-step on,
# each gather that matches the recorded order starts the all-gathers of the following units
# asynchronously, up to stage3_prefetch_bucket_size elements ahead and never beyond
# stage3_max_live_parameters gathered at once, so communication overlaps compute. A unit whose
# next recorded use comes within stage3_max_reuse_distance elements of other units' gathers (the
# last block always: its backward comes next) stays gathered after its forward, as in DeepSpeed;
# with DeepSpeed's default (1e9) a model under a billion parameters is gathered once per step, and
# 0 re-gathers every block for its backward (FSDP's reshard_after_forward). The trace records
# every *use* of a unit (a kept unit's reuse too), so it is the same each step either way. When the order stops matching (dynamic control flow), the rest of the
# micro-step gathers on demand and the new order is recorded (debug log); every rank follows its
# own identical trace, so collectives stay in the same order on all ranks.

Gathered buffers are allocated fresh and never recycled while gathered views might still be
referenced: autograd may have saved a view of a weight (e.g. `w.t()`) for backward, and a recycled
buffer would silently feed it another unit's numbers. Released storage is freed by refcounting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from engine import comm
from engine.checkpoint.clone import clone_tensors_for_torch_save
from engine.checkpoint.records import ShardRecord, layout_pieces
from engine.config import ConfigError
from engine.config.types import ARENA_AUTO, EngineConfig
from engine.monitor.log import get_logger
from engine.ops.flatten import copy_into
from engine.precision import Precision
from engine.zero import partitioned_init
from engine.zero import memory_efficient_linear
from engine.zero import owners, released, shard_reduce
from engine.zero.base import StepOutcome
from engine.zero.flat_groups import bind_shards, check_elementwise
from engine.zero.layout import GroupLayout, build_layout
from engine.zero.offload import OffloadTarget, OptimizerOffload, offload_enabled
from engine.zero.stage3_memory import Stage3Memory, UnitBytes, auto_capacity
from engine.zero.units import leaf_test, plan_units

logger = get_logger()

MAX_REDUCES_IN_FLIGHT = 2
"""Gradient reduce-scatters (one per unit, optimizer group and dtype) in flight before the oldest is
waited for and its bucket recycled."""


@dataclass
class ShardedGroup:
    """The parameters of one unit that share an optimizer param group and a dtype."""

    params: list[torch.nn.Parameter]
    names: list[str]
    layout: GroupLayout
    shard: torch.Tensor | None
    """This rank's slice of the unit's flat buffer in the parameter dtype: the persistent storage of
    frozen and fp32 parameters. None for trainable low-precision groups, whose only copy is the fp32
    master (cast while gathering, as FSDP2 does: 4 instead of 2 + 4 bytes per element)."""
    opt_group: int | None
    """Index of the optimizer param group; None for frozen parameters (gathered, never updated)."""
    dtype: torch.dtype
    device: torch.device
    master: torch.Tensor | None = None
    """fp32 optimizer parameter: the shard itself in fp32, a copy otherwise (None when frozen)."""
    shard_grad: torch.Tensor | None = None
    full: torch.Tensor | None = None
    """The gathered flat buffer while the unit is gathered."""
    grad_bucket: torch.Tensor | None = None
    grad_written: bool = False
    arrived: set[int] = field(default_factory=set)
    pending: shard_reduce.PendingReduce | None = None
    unit_name: str = ""


@dataclass
class Unit:
    index: int
    name: str
    modules: list[torch.nn.Module]
    """Whose forwards use it (see units.UnitPlan); empty for the root unit."""
    groups: list[ShardedGroup]
    gathered: bool = False
    reduced: bool = False
    """Its gradients of this backward were sent."""

    @property
    def trainable(self) -> list[ShardedGroup]:
        return [g for g in self.groups if g.opt_group is not None]


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit before its backward runs."""

    @staticmethod
    def forward(ctx: Any, stage: Stage3, unit: Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.stage, ctx.unit = stage, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.unit.reduced:
            ctx.stage._gather(ctx.unit)
        return (None, None, *grads)


class Stage3:
    stage = 3

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: EngineConfig,
                 precision: Precision) -> None:
        # Without an optimizer (ZeRO inference: HF evaluates before training this way) every parameter
        # is sharded as a frozen one: gathered unit by unit for forward, never updated. The Engine
        # refuses backward and step.
        if optimizer is not None:
            check_elementwise(optimizer, 3, config.zero_allow_untested_optimizer)
        self.optimizer = optimizer
        self.precision = precision
        self._world = comm.get_world_size()
        self._rank = comm.get_rank()
        self._averaging = shard_reduce.Averaging.from_config(config, comm.get_world_size())
        self._prefetch_numel = config.zero.stage3_prefetch_bucket_size
        self._max_live_numel = config.zero.stage3_max_live_parameters
        self._persist_below = config.zero.stage3_param_persistence_threshold
        self._max_reuse_numel = config.zero.stage3_max_reuse_distance
        self.module = module
        # Prefetch (see [Note: prefetch]): the unit gather order of the last micro-step, where this
        # micro-step is in it, and the all-gathers already in flight.
        self._trace: list[int] | None = None
        self._recording: list[int] = []
        self._pos = 0
        self._following = True
        self._inflight: dict[int, list[Any]] = {}
        self.prefetched_gathers = 0
        self.order_changes = 0
        self.steps = 0
        self.backwards = 0

        opt_groups = optimizer.param_groups if optimizer is not None else []
        group_of = {id(p): gi for gi, g in enumerate(opt_groups) for p in g["params"] if p.requires_grad}
        self.units: list[Unit] = []
        is_leaf = leaf_test(config.zero.leaf_module)
        if config.zero.leaf_module and not any(is_leaf(n, m) for n, m in module.named_modules() if m is not module):
            raise ConfigError(f"zero_optimization.leaf_module {dict(config.zero.leaf_module)} matches no submodule "
                              f"of {type(module).__name__}; name classes (type(m).__name__), module names or "
                              "name suffixes as in model.named_modules()")
        for plan in plan_units(module, is_leaf, merge_below=config.zero.stage3_module_granularity_threshold):
            keys: dict[tuple[int | None, torch.dtype], list[int]] = {}
            for i, p in enumerate(plan.params):
                keys.setdefault((group_of.get(id(p)), p.dtype), []).append(i)
            groups = [self._shard(plan.params, plan.param_names, idx, opt_group)
                      for (opt_group, _), idx in keys.items()]
            unit = Unit(len(self.units), plan.name, plan.modules, groups)
            self.units.append(unit)
            handle = owners.UnitHandle(gather=lambda unit=unit: self.gather_for_user(unit),
                                       release=lambda unit=unit: self.release_for_user(unit),
                                       scatter_from=lambda src, unit=unit: self.scatter_from(unit, src))
            for p in plan.params:
                owners.set_unit(p, handle)  # for engine.zero.GatheredParameters
        masters: dict[int, list[torch.Tensor]] = {gi: [] for gi in range(len(opt_groups))}
        for unit in self.units:
            for g in unit.trainable:
                masters[g.opt_group].append(g.master)
        if optimizer is not None:
            bind_shards(optimizer, [masters[gi] for gi in range(len(opt_groups))])

        self._where = {id(p): (u, g, i) for u in self.units for g in u.trainable for i, p in enumerate(g.params)}
        # Optimizer offload: masters are the only persistent copy of trainable parameters (or the fp32
        # shard itself), gathering casts, so the fused step has no low-precision copy to write.
        self._offload = OptimizerOffload(optimizer, [
            OffloadTarget(g.master, None) for u in self.units for g in u.trainable
        ]) if offload_enabled(config) and optimizer is not None else None
        # Gradients are reduced unit by unit in one fixed order on every rank: the reverse of the
        # forward order, so the last block (whose backward ends first) goes first, the root last.
        self._reduce_order = list(reversed(self.units))
        self._next_reduce = 0
        self._handles: list[Any] = []
        self._register_hooks(module)
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._memory = self._build_memory(config)
        self._linear_installed = config.zero.memory_efficient_linear
        if self._linear_installed:
            memory_efficient_linear.install()
        self._reducing: deque[ShardedGroup] = deque()

    # ----------------------------------------------------------------------------- building
    def _build_memory(self, config: EngineConfig) -> Stage3Memory:
        """Gathered buffers and gradient buckets: an arena sized by zero_optimization.stage3_arena_bytes
        ("auto": from the units), or the default allocator (0, the default, or not a CPU model)."""
        groups = [g for u in self.units for g in u.groups]
        device = groups[0].device if groups else torch.device("cpu")
        needs = [UnitBytes(gathered=sum(g.layout.padded_numel * g.dtype.itemsize for g in u.groups),
                           buckets=sum(g.layout.padded_numel * self.precision.wire_dtype(g.dtype).itemsize
                                       for g in u.trainable),
                           persistent=self._unit_numel(u) < self._persist_below, root=not u.modules)
                 for u in self.units]
        widest = max((g.dtype.itemsize for g in groups), default=4)
        requested = config.zero.stage3_arena_bytes
        auto = requested == ARENA_AUTO
        capacity = auto_capacity(needs, self._max_live_numel * widest, MAX_REDUCES_IN_FLIGHT) if auto else requested
        # Without the arena, gradient buckets are recycled by a pool whose buffers all have the size
        # of the largest block, so units of any size share them.
        blocks = [u for u in self.units if u.modules] or self.units
        return Stage3Memory(capacity, device, max((self._unit_numel(u) for u in blocks), default=0), self._rank,
                            auto=auto)

    def _shard(self, params: list[torch.nn.Parameter], names: list[str], idx: list[int],
               opt_group: int | None) -> ShardedGroup:
        members = [params[i] for i in idx]
        for p in members:
            if not partitioned_init.is_partitioned(p):
                p.ds_shape, p.ds_numel = tuple(p.shape), p.numel()  # DeepSpeed's names for the full shape
        layout = build_layout([p.ds_shape for p in members], world_size=self._world,
                              bucket_size=max(1, sum(p.ds_numel for p in members)),
                              element_size=members[0].element_size())
        assert layout.num_buckets == 1
        dtype, device = members[0].dtype, members[0].device
        flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for p, span in zip(members, layout.params):
            # Built under engine.zero.Init: re-laid from its own partition (one parameter at a time).
            value = partitioned_init.full_value(p, dtype).to(device) if partitioned_init.is_partitioned(p) else p.data
            flat[span.offset:span.end].copy_(value.reshape(-1))
            del value
        start, end = layout.slice_range(0, self._rank)
        shard = flat[start:end].clone()
        del flat
        group = ShardedGroup(members, [names[i] for i in idx], layout, shard, opt_group, dtype=dtype, device=device)
        for p, name in zip(members, group.names):
            p.data = torch.empty(0, dtype=dtype, device=device)
            if partitioned_init.is_partitioned(p):
                del p._zero_init_shard
            released.adopt(p, name)
        if opt_group is not None:
            group.master = shard if dtype == torch.float32 else shard.to(torch.float32)
            if dtype != torch.float32:
                group.shard = None
            group.shard_grad = torch.zeros(layout.slice_numel, dtype=torch.float32, device=device)
            group.master.grad = group.shard_grad
        return group

    def _register_hooks(self, module: torch.nn.Module) -> None:
        root = next((u for u in self.units if not u.modules), None)
        self._handles.append(module.register_forward_pre_hook(lambda _m, _i: self._start_forward()))
        if root is not None:
            self._handles.append(module.register_forward_pre_hook(lambda _m, _i: self._gather(root)))
            self._handles.append(module.register_forward_hook(lambda _m, _i, _o: self._after_root_forward(root)))
        for unit in self.units:
            for member in unit.modules:
                self._handles.append(member.register_forward_pre_hook(lambda _m, _i, unit=unit: self._gather(unit)))
                self._handles.append(member.register_forward_hook(
                    lambda m, _i, out, unit=unit: self._after_forward(unit, out, last=m is unit.modules[-1])))
        for unit in self.units:
            for g in unit.trainable:
                for p in g.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ------------------------------------------------------------------------- gather/release
    def _start_gather(self, unit: Unit) -> list[Any]:
        # Every buffer first: an allocation that fails (a full arena) then fails before any collective
        # starts, on every rank alike, and leaves nothing allocated.
        fulls = [self._memory.gathered(g.layout.padded_numel, g.dtype, g.device, unit.name) for g in unit.groups]
        works = []
        for g, full in zip(unit.groups, fulls):
            g.full = full
            start, end = g.layout.slice_range(0, self._rank)
            mine = g.full[start:end]
            # This rank's slice goes straight into its place in the gathered buffer (cast from the fp32
            # master in the same pass for bf16/fp16), and the all-gather runs in place around it.
            copy_into(g.full, [g.shard if g.shard is not None else g.master], [start])
            works.append(comm.all_gather(g.full, mine, async_op=True, key=unit.index))
            self.gathered_bytes += g.full.numel() * g.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        return works

    def _gather(self, unit: Unit) -> None:
        if unit.gathered:  # kept since its last use: still a use in the recorded order
            self._follow_trace(unit)
            return
        works = self._inflight.pop(unit.index, None)
        if works is None:
            works = self._start_gather(unit)
        for work in works:
            comm.wait(work, f"all-gather of stage-3 unit {unit.name!r} ({self._where_in_training()})")
        for g in unit.groups:
            for p, span in zip(g.params, g.layout.params):
                p.data = g.full[span.offset:span.end].view(p.ds_shape)
                p._zero_released = False
        unit.gathered = True
        self._follow_trace(unit)

    def _follow_trace(self, unit: Unit) -> None:
        """Record this gather and, while the recorded order holds, prefetch the next units."""
        self._recording.append(unit.index)
        if self._trace is None or not self._following or not torch.is_grad_enabled() and not self._in_backward():
            return
        if self._pos < len(self._trace) and self._trace[self._pos] == unit.index:
            self._pos += 1
            self._prefetch()
            return
        self._following = False
        self.order_changes += 1
        logger.debug("stage 3: unit %s gathered out of the recorded order; gathering on demand and re-recording",
                     unit.name)

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _unit_numel(self, unit: Unit) -> int:
        return sum(g.layout.padded_numel for g in unit.groups)

    def _prefetch(self) -> None:
        assert self._trace is not None
        budget = self._prefetch_numel
        live = sum(self._unit_numel(u) for u in self.units if u.gathered or u.index in self._inflight)
        for index in self._trace[self._pos:]:
            unit = self.units[index]
            if unit.gathered or index in self._inflight:
                continue
            numel = self._unit_numel(unit)
            if numel > budget or live + numel > self._max_live_numel:
                return
            self._inflight[index] = self._start_gather(unit)
            self.prefetched_gathers += 1
            budget -= numel
            live += numel

    def _drop_prefetched(self) -> None:
        """Wait for (collectives cannot be cancelled) and free gathers nobody used."""
        for index, works in list(self._inflight.items()):
            for work in works:
                comm.wait(work, "a prefetched all-gather nobody used")
            unit = self.units[index]
            for g in unit.groups:
                self.gathered_bytes -= g.full.numel() * g.full.element_size()
                g.full = None
        self._inflight.clear()

    def _end_of_micro_step(self) -> None:
        """After a backward: keep the recorded order, or adopt a changed one; start over."""
        self._drop_prefetched()
        if self._recording and self._trace != self._recording:
            self._trace = list(self._recording)
        self._recording = []
        self._pos = 0
        self._following = True

    def _release(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        for g in unit.groups:
            for p in g.params:
                p.data = torch.empty(0, dtype=g.dtype, device=g.device)
                p._zero_released = True
            self.gathered_bytes -= g.full.numel() * g.full.element_size()
            g.full = None
        unit.gathered = False

    def _start_forward(self) -> None:
        """A new forward of the whole model: a new micro-step in the recorded order."""
        if self._recording and not self._in_backward():
            self._drop_prefetched()
            self._recording, self._pos, self._following = [], 0, True

    def _after_root_forward(self, root: Unit) -> None:
        if not torch.is_grad_enabled():
            self._release(root)  # evaluation: nothing will come back for it

    def _reused_soon(self, unit: Unit) -> bool:
        """Whether the recorded order uses `unit` again before other units of more than
        stage3_max_reuse_distance elements in all are used (the last block, whose backward comes
        next: always), and keeping it stays within stage3_max_live_parameters."""
        if not (self._trace and self._following):
            return False
        live = sum(self._unit_numel(u) for u in self.units if u.gathered or u.index in self._inflight)
        if live > self._max_live_numel:
            return False
        between: set[int] = set()  # distinct units used before its next use
        for index in self._trace[self._pos:]:
            if index == unit.index:
                return True
            if index not in between:
                between.add(index)
                if sum(self._unit_numel(self.units[i]) for i in between) > self._max_reuse_numel:
                    return False
        return False

    def _after_forward(self, unit: Unit, output: Any, last: bool = True) -> Any:
        if not last:
            pass  # a merged unit: the next member's forward uses it too
        elif not torch.is_grad_enabled():
            self._release(unit)
        elif self._unit_numel(unit) < self._persist_below:
            pass  # small: cheaper to keep whole until its gradients are reduced than to gather it again
        elif not self._reused_soon(unit):
            self._release(unit)
        if not torch.is_grad_enabled() or not unit.trainable:
            return output
        flat, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not positions:
            return output
        wrapped = _GatherBeforeBackward.apply(self, unit, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        unit.reduced = False
        return tree_unflatten(flat, spec)

    # ---------------------------------------------------------------------------- gradients
    def _on_grad(self, param: torch.Tensor) -> None:
        unit, g, i = self._where[id(param)]
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if g.grad_bucket is None:
            g.grad_bucket = self._memory.bucket(g.layout.padded_numel, self.precision.wire_dtype(grad.dtype),
                                                grad.device, unit.name)
        span = g.layout.params[i]
        if i in g.arrived:
            g.grad_bucket[span.offset:span.end].add_(grad.reshape(-1))
        else:
            g.grad_bucket[span.offset:span.end].copy_(grad.reshape(-1))
            g.arrived.add(i)
        if self._complete(unit):
            self._reduce_in_order(complete_only=True)

    def _complete(self, unit: Unit) -> bool:
        return all(len(g.arrived) == len(g.params) for g in unit.trainable)

    def _reduce_in_order(self, *, complete_only: bool) -> None:
        while self._next_reduce < len(self._reduce_order):
            unit = self._reduce_order[self._next_reduce]
            if complete_only and not self._complete(unit):
                return
            self._launch_reduce(unit)
            self._next_reduce += 1

    def _launch_reduce(self, unit: Unit) -> None:
        for g in unit.trainable:
            if g.grad_bucket is None:  # no gradient on this rank: contribute zeros
                g.grad_bucket = self._memory.bucket(g.layout.padded_numel, self.precision.wire_dtype(g.dtype),
                                                    g.device, unit.name).zero_()
            else:  # a pooled buffer: whatever no gradient was written to must be zero (padding included)
                for i, span in enumerate(g.layout.params):
                    if i not in g.arrived:
                        g.grad_bucket[span.offset:span.end].zero_()
                g.grad_bucket[g.layout.numel:].zero_()
            g.pending = shard_reduce.start(g.grad_bucket, g.shard_grad, written=g.grad_written, rank=self._rank,
                                           averaging=self._averaging, key=unit.index)
            g.unit_name = unit.name
            self._reducing.append(g)
        unit.reduced = True
        self._release(unit)
        # At most MAX_REDUCES_IN_FLIGHT groups' buckets stay alive: the rest of the backward overlaps
        # them, and the bucket memory is a few units', not the model's.
        while len(self._reducing) > MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce(self._reducing.popleft())

    def _where_in_training(self) -> str:
        return f"optimizer step {self.steps + 1}, backward {self.backwards + 1}"

    def _finish_reduce(self, g: ShardedGroup) -> None:
        if g.pending is None:
            return
        shard_reduce.finish(g.pending, g.shard_grad, written=g.grad_written,
                            what=f"reduce-scatter of stage-3 unit {g.unit_name!r} gradients ({self._where_in_training()})")
        g.pending = None
        g.grad_written = True
        g.arrived.clear()
        self._memory.release_bucket(g.grad_bucket)
        g.grad_bucket = None

    def _pending(self) -> bool:
        return any(g.arrived for u in self.units for g in u.trainable)

    def _flush(self) -> None:
        """Reduce every unit not reduced yet in this backward, wait for all, release everything."""
        if self._next_reduce > 0 or self._pending():
            self._reduce_in_order(complete_only=False)
        for unit in self.units:
            for g in unit.trainable:
                self._finish_reduce(g)
            self._release(unit)
        self._reducing.clear()
        self._next_reduce = 0

    # ------------------------------------------------------------------------ stage interface
    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        if not sync:
            raise RuntimeError("engine.no_sync() is not supported at zero_optimization.stage 3 (gradients are "
                               "partitioned as they are produced, as in DeepSpeed); use gradient_accumulation_steps "
                               "to accumulate micro-batches")

    def finish_backward(self) -> None:
        self._flush()
        self._end_of_micro_step()
        self.backwards += 1

    def step(self, max_grad_norm: float) -> StepOutcome:
        self._flush()
        self._drop_prefetched()
        shards = [g.shard_grad for u in self.units for g in u.trainable]
        for u in self.units:
            for g in u.trainable:
                if not g.grad_written:
                    g.shard_grad.zero_()
        average = self._averaging.after
        norm, applied = self.precision.step_shards(shards, self.optimizer, max_grad_norm=max_grad_norm,
                                                   average=average, partitioned=True,
                                                   fused_step=self._offload.step if self._offload else None)
        self.zero_grad()
        self.steps += 1
        return StepOutcome(norm, applied)

    def zero_grad(self) -> None:
        for u in self.units:
            for g in u.trainable:
                if g.pending is not None:
                    g.pending.work.wait()
                    g.pending = None
                if g.grad_bucket is not None:
                    self._memory.release_bucket(g.grad_bucket)
                    g.grad_bucket = None
                g.grad_written = False
                g.arrived.clear()
                for p in g.params:
                    p.grad = None
        self._reducing.clear()
        self._next_reduce = 0

    def memory_report(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        groups = [g for u in self.units for g in u.groups]
        opt_state = self.optimizer.state if self.optimizer is not None else {}
        state = sum(nbytes(v) for g in groups if g.master is not None
                    for v in opt_state.get(g.master, {}).values() if torch.is_tensor(v) and v.numel() > 1)
        return {
            "params": sum(nbytes(g.shard) for g in groups),
            "master": sum(nbytes(g.master) for g in groups if g.master is not None and g.shard is None),
            "gradients": sum(nbytes(g.shard_grad) for g in groups),
            "optimizer_state": state,
            **self._memory.report(),
            "gathered": self.gathered_bytes,
            "peak_gathered": self.peak_gathered_bytes,
        }

    # ----------------------------------------------------------------------- user gathering
    def gather_for_user(self, unit: Unit) -> bool:
        """Gather a unit for GatheredParameters; False when it was already gathered (leave it so)."""
        if unit.gathered:
            return False
        self._gather(unit)
        return True

    def release_for_user(self, unit: Unit) -> None:
        self._release(unit)

    def scatter_from(self, unit: Unit, src: int) -> None:
        """After a user modified the gathered unit on rank `src`: everyone takes src's values and
        writes its own slice back into the shard and the fp32 master."""
        for g in unit.groups:
            comm.broadcast(g.full, src=src)
            lo, hi = g.layout.slice_range(0, self._rank)
            mine = g.full[lo:hi]
            for target in (g.shard, g.master):
                if target is not None:
                    target.copy_(mine)

    def consolidated_state_dict(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The module's full state dict on rank 0 (empty elsewhere), in the parameters' dtype, gathered
        one unit at a time, so no rank ever holds more than one unit beyond its shards (and rank 0 the
        result). Copies go to `device` (None: where the parameters live); a parameter under several
        names (tied weights) is one tensor under each, as in module.state_dict()."""
        keys = self.module.state_dict(keep_vars=True)
        copies: dict[int, torch.Tensor] = {}  # id(parameter or buffer) -> its copy

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in copies:
                copies[id(tensor)] = clone_tensors_for_torch_save(tensor, device)
            return copies[id(tensor)]

        for unit in self.units:
            opened = self.gather_for_user(unit)
            members = {id(p) for g in unit.groups for p in g.params}
            if self._rank == 0:
                for tensor in keys.values():
                    if id(tensor) in members:
                        copy(tensor)
            if opened:
                self._release(unit)
        if self._rank != 0:
            return {}
        return {name: copy(tensor) for name, tensor in keys.items()}  # buffers and unmanaged params copied here

    def checkpoint_shards(self) -> list[ShardRecord]:
        """Every group's shard on this rank: fp32 masters of trainable groups, frozen shards as they are."""
        records = []
        for u in self.units:
            for g in u.groups:
                tensor = g.master if g.opt_group is not None else g.shard
                records.append(ShardRecord(tensor, layout_pieces(g.layout, self._rank, g.names), g.opt_group, True))
        return records

    def state_dict(self) -> dict[str, object]:
        return {}

    def destroy(self) -> None:
        """Give the module back whole (every parameter gathered into its own storage), then drop
        hooks, shards, masters and gradient buckets."""
        self._drop_prefetched()
        self._trace = None
        self.zero_grad()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._linear_installed:
            memory_efficient_linear.uninstall()
            self._linear_installed = False
        self._memory.close_arena()  # the module's own storage: plain allocations that outlive the stage
        for unit in self.units:
            self._gather(unit)
            for g in unit.groups:
                for p in g.params:
                    p.data = p.data.clone()
                    owners.set_unit(p, None)
                    released.give_back(p)
                g.full = None
                if g.master is not None:
                    g.master.grad = None
            unit.gathered = False
        self.units.clear()
        self._where.clear()
        self._memory.clear()
        self.gathered_bytes = 0
        comm.free_buffers()
