"""Stage 3: parameters, gradients and optimizer state partitioned; full parameters exist only while
the unit that owns them computes (paper 5.3, 7.2.2).

`Stage3` wires small objects together and implements the stage interface (engine/zero/base.py):

    unit_plan.py    which parameters form a gather unit (one all-gather each)
    units.py        the units as data: sharded groups, UnitState, building the shards
    prefetch.py     PrefetchPlan: the recorded unit order, what to prefetch or keep
                    (pure: indices and sizes only; [Note: prefetch])
    gather.py       UnitGathers: gather, release and prefetch; the forward hooks and
                    the unit lifecycle in a step
    grads.py        UnitGradients: gradient buckets, reduced unit by unit in order
    memory.py       where gathered buffers and gradient buckets come from

The root unit (parameters outside the repeated blocks: embeddings, final norm, a tied head) is
gathered when the model's forward starts and stays gathered until its gradients are reduced.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from engine import comm
from engine.config.errors import ConfigError
from engine.config.types import EngineConfig
from engine.offload.nvme_setup import NvmeSettings, map_gradients, nvme_settings, open_swap_dir
from engine.offload.swap_dir import SwapDir
from engine.ops.overflow import KnownSquares
from engine.parallel.groups import ParallelGroups
from engine.precision import Precision
from engine.zero import fragments, owners, released, shard_reduce
from engine.zero.base import StepOutcome
from engine.zero.clone import clone_tensors_for_torch_save
from engine.zero.flat_groups import bind_shards
from engine.zero.master_step import MasterStep, MasterTarget, offload_enabled
from engine.zero.norm_scope import NormScope, counted_rows, counted_runs
from engine.zero.offload_states import OffloadStateTypeEnum
from engine.zero.records import ShardRecord, layout_pieces
from engine.zero.shard_step import step_on_gradients
from engine.zero.stage3 import holdings, memory_efficient_linear
from engine.zero.stage3.gather import UnitGathers
from engine.zero.stage3.grads import MAX_REDUCES_IN_FLIGHT, UnitGradients
from engine.zero.stage3.hooks import StageHooks
from engine.zero.stage3.memory import build_memory
from engine.zero.stage3.parameter_offload import ParameterOffload
from engine.zero.stage3.prefetch import PrefetchPlan
from engine.zero.stage3.secondary import secondary_shards
from engine.zero.stage3.units import TrainableGroup, Unit, UnitState, build_units
from engine.zero.tp_state import whole_state_dict


class Stage3:
    stage = 3

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: EngineConfig,
        precision: Precision,
        parallel: ParallelGroups | None = None,
    ) -> None:
        # Without an optimizer (ZeRO inference: HF evaluates before training this way) every parameter
        # is sharded as a frozen one: gathered unit by unit for forward, never updated. The Engine
        # refuses backward and step.
        self.optimizer = optimizer
        self.precision = precision
        self.module = module
        self.parallel = parallel or ParallelGroups.data_parallel_only()
        """Parameters are partitioned over the data-parallel group (the world without tensor parallelism)."""
        self._rank = self.parallel.dp_rank
        """This rank's position in the data-parallel group: which slice of every unit it keeps."""
        self._group = self.parallel.dp_group
        self._averaging = shard_reduce.Averaging.from_config(config, self.parallel.dp_size)
        self.steps = 0  # optimizer steps and backwards so far, to say where in training an error happened
        self.backwards = 0

        nvme = self._nvme_settings(config, optimizer)
        self.units: list[Unit] = build_units(
            module,
            optimizer,
            config.zero.leaf_module,
            config.zero.stage3_module_granularity_threshold,
            world=self.parallel.dp_size,
            rank=self._rank,
            grad_dtype=precision.grad_accum_dtype,
            allocate_grads=nvme is None,
        )
        swap_dir = self._map_gradients(nvme) if nvme is not None else None
        trainable = [g for u in self.units for g in u.trainable]
        self.master_step = self._bind_optimizer(config, trainable, nvme, swap_dir)
        self.offload = self.master_step.swap if self.master_step is not None else None
        """The NVMe swap of the optimizer state, masters and gradients (engine/offload/), or None."""
        self._register_owners()
        self._norm_scope = NormScope.of(self.parallel, partitioned=True)
        self._norm_runs = [(g, counted_runs(g.layout, self._rank, g.params, self.parallel)) for g in trainable]
        """Each trainable group with the runs of its gradient shard this rank counts in the global norm."""
        self._norm_runs_of = {id(g): runs for g, runs in self._norm_runs}

        zero = config.zero
        # Which units to prefetch or keep (pure bookkeeping); the gathers and the gradient reduction
        # that act on the units; the memory both take their buffers from.
        self._plan = PrefetchPlan(
            [u.numel for u in self.units],
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_numel=zero.stage3_max_reuse_distance,
            persist_below=zero.stage3_param_persistence_threshold,
        )
        self._memory = build_memory(
            self.units, self._plan, precision.wire_dtype, zero.stage3_arena_bytes, MAX_REDUCES_IN_FLIGHT
        )
        self._grads = UnitGradients(
            self.units,
            self._memory,
            precision,
            self._averaging,
            self._rank,
            release=lambda unit: self._gathers.release(unit),
            where=self._where_in_training,
            group=self._group,
            offload=self.offload,
            counted_pieces=self._counted_pieces,
        )
        self._gathers = self._build_gathers(zero.offload_param.buffer_count, zero.zero_hpz_partition_size)
        self.hooks = StageHooks(module, self.units, self._gathers, self._grads.on_grad)
        self.hooks.register()
        self.parameter_offload = ParameterOffload(self)  # DeepSpeed's optimizer.parameter_offload (TRL's generation)
        self._linear_installed = zero.memory_efficient_linear
        if self._linear_installed:
            memory_efficient_linear.install()

    # ----------------------------------------------------------------------------- building
    @staticmethod
    def _nvme_settings(config: EngineConfig, optimizer: torch.optim.Optimizer | None) -> NvmeSettings | None:
        """ZeRO-Infinity's settings when this stage trains with NVMe offload, else None."""
        nvme = nvme_settings(config)
        if nvme is not None and nvme.params and optimizer is None:
            raise ConfigError(
                'zero_optimization.offload_param.device "nvme" without an optimizer (evaluation or ZeRO-Inference): '
                "parameters go to NVMe here only with the optimizer state (training); use offload_param "
                '"cpu"/"none" for an engine without optimizer'
            )
        return nvme if optimizer is not None else None

    def _map_gradients(self, nvme: NvmeSettings) -> SwapDir:
        """ZeRO-Infinity keeps shard gradients on NVMe too (as DeepSpeed does): mapped files in a new swap folder."""
        swap_dir = open_swap_dir(nvme)
        to_map = [t for u in self.units for t in u.trainable]
        sizes = [(t.layout.slice_numel, t.shard_grad.dtype) for t in to_map]
        try:
            grads = map_gradients(swap_dir, sizes)
        except BaseException:
            swap_dir.close()  # a failed start leaves no folder behind, so the next one starts clean
            raise
        for t, grad in zip(to_map, grads):
            t.shard_grad = grad
        return swap_dir

    def _build_gathers(self, read_ahead_units: int, hpz_size: int) -> UnitGathers:
        """The units' gathers; with the masters on NVMe, each gather reads its unit's from the swap files,
        `read_ahead_units` (offload_param.buffer_count, >= 0 by the schema) units ahead."""
        gathers = UnitGathers(
            self.units,
            self._plan,
            self._memory,
            self._rank,
            self._where_in_training,
            grads_sent=self._grads.sent,
            group=self._group,
            secondary=secondary_shards(hpz_size, list(self.parallel.dp_ranks)),
        )
        if self.offload is not None and self.offload.settings.params:  # masters on NVMe: each gather reads its unit's
            gathers.read_stored = self.offload.start_read_master
            gathers.read_ahead_units = read_ahead_units
        return gathers

    def _register_owners(self) -> None:
        """Each parameter's unit handle (GatheredParameters, the stage-3 linear); its HeldState (zero/fragments.py)."""
        for unit in self.units:
            handle = owners.UnitHandle(
                gather=partial(self.gather_for_user, unit),
                release=partial(self.release_for_user, unit),
                scatter_from=partial(self.scatter_from, unit),
                status=unit.ds_status,
                grad_slot=lambda param, dtype: self._grads.slot(param, dtype),
            )
            for g in unit.groups:
                for p in g.params:
                    owners.set_unit(p, handle)
        if self.optimizer is not None:
            fragments.HeldState(
                [g.held(self._rank) for u in self.units for g in u.trainable],
                stage=3,
                optimizer=self.optimizer,
                group=self._group,
                replicated=False,
                averaging=self._averaging,
                precision=self.precision,
                offload=self.offload,
            ).register()

    def _bind_optimizer(
        self,
        config: EngineConfig,
        trainable: list[TrainableGroup],
        nvme: NvmeSettings | None,
        swap_dir: SwapDir | None,
    ) -> MasterStep | None:
        """Point the optimizer at the trainable groups' fp32 masters and set up the step over them; None
        without an optimizer. The masters are the only persistent copy of trainable parameters (or the
        fp32 shard itself): gathering casts, so the step has no low-precision copy to write."""
        optimizer = self.optimizer
        if optimizer is None:
            return None
        bind_shards(
            optimizer,
            [[g.master for g in trainable if g.opt_group == gi] for gi in range(len(optimizer.param_groups))],
        )
        return MasterStep(
            optimizer,
            [MasterTarget(g.master, g.shard_grad, None) for g in trainable],
            offload=offload_enabled(config),
            nvme=dataclasses.replace(nvme, grads=True) if nvme is not None else None,
            swap_dir=swap_dir,
        )

    # ----------------------------------------------------------------------------- building
    @property
    def prefetch_plan(self) -> PrefetchPlan:
        return self._plan

    def drop_prefetched(self) -> None:
        """Wait for and drop gathers started ahead that nobody used."""
        self._gathers.drop_prefetched()

    def _where_in_training(self) -> str:
        return f"optimizer step {self.steps + 1}, backward {self.backwards + 1}"

    # ------------------------------------------------------------------------ stage interface
    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        self._grads.window_ends = boundary
        if not sync:
            raise RuntimeError(
                "engine.no_sync() is not supported at zero_optimization.stage 3 (gradients are "
                "partitioned as they are produced, as in DeepSpeed); use gradient_accumulation_steps "
                "to accumulate micro-batches"
            )

    def finish_backward(self) -> None:
        self._grads.flush()
        self._gathers.end_micro_step()
        self.backwards += 1

    def step(self, max_grad_norm: float) -> StepOutcome:
        if self.optimizer is None:
            raise RuntimeError("stage 3 was built without an optimizer (evaluation only): it has nothing to step")
        # Every gradient of the window reduced into the shard gradients, nothing left gathered.
        self._grads.flush()
        self._gathers.drop_prefetched()
        if self._gathers.secondary is not None:  # the masters change: no secondary shard may outlive the step
            self._gathers.secondary.drop_all()
        if self.offload is not None:  # the last step, if it still runs behind the forward, first; this one's order
            self.offload.finish()
            self.offload.order = self._forward_order()
        # Norm, clipping, the optimizer step on the shards (rows no reduction wrote are zeroed first).
        assert self.master_step is not None
        outcome = step_on_gradients(
            self.precision,
            self._norm_rows,
            stale=self._grads.stale_rows(),
            averaging=self._averaging,
            max_grad_norm=max_grad_norm,
            scope=self._norm_scope,
            update=self.master_step.step,
        )
        # A new accumulation window.
        self.zero_grad()
        self.steps += 1
        return outcome

    def _forward_order(self) -> list[torch.Tensor]:
        """The masters in the order of the units' first uses in the recorded trace, then the rest."""
        first_uses = dict.fromkeys(self._plan.trace or [])
        order = [*first_uses, *(u.index for u in self.units if u.index not in first_uses)]
        by_index = {u.index: u for u in self.units}
        return [g.master for i in order for g in by_index[i].trainable]

    def _norm_rows(self) -> list[torch.Tensor | KnownSquares]:
        """What the norm counts, group by group: the partial sums taken as the reduction landed, else the rows."""
        rows: list[torch.Tensor | KnownSquares] = []
        for g, runs in self._norm_runs:
            rows += (
                [g.norm_squares]
                if g.norm_squares is not None
                else counted_rows(g.shard_grad, runs, g.layout.slice_numel)
            )
        return rows

    def _counted_pieces(self, g: TrainableGroup, values: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of `values` (a group's shard gradient, or its reduced values) the norm counts."""
        return counted_rows(values, self._norm_runs_of[id(g)], g.layout.slice_numel)

    def zero_grad(self) -> None:
        self._grads.zero_grad()

    def resident_states(self) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
        return holdings.resident_states(self.units, self.optimizer)

    def release_scratch(self) -> None:
        self._memory.release_scratch()

    def empty_partition_cache(self) -> None:
        """Release every gathered unit, kept ones too (persistent, or kept for reuse), and drop prefetched gathers
        (DeepSpeed's empty_partition_cache): between steps no parameter holds more than this rank's shard."""
        self._gathers.drop_prefetched()
        for unit in self.units:
            self._gathers.release(unit)

    def memory_report(self) -> dict[str, int]:
        grads_on_disk = self.offload is not None and self.offload.settings.grads  # counted in "nvme"
        return {
            **holdings.held_bytes(self.units, self.optimizer, grads_on_disk),
            **self._memory.report(),
            "gathered": self._gathers.gathered_bytes,
            **({"secondary": self._gathers.secondary.peak_nbytes} if self._gathers.secondary is not None else {}),
            "peak_gathered": self._gathers.peak_gathered_bytes,
            **({"nvme": self.offload.disk_bytes()} if self.offload is not None else {}),
        }

    @property
    def prefetched_gathers(self) -> int:
        """All-gathers started ahead of use (see [Note: prefetch])."""
        return self._gathers.prefetched

    @property
    def order_changes(self) -> int:
        """Micro-steps whose unit order left the recorded one."""
        return self._plan.order_changes

    # ----------------------------------------------------------------------- user gathering
    def gather_for_user(self, unit: Unit) -> bool:
        """Gather a unit for GatheredParameters; False when it was already gathered (leave it so)."""
        if unit.state is UnitState.GATHERED:
            return False
        self._gathers.gather(unit)
        return True

    def release_for_user(self, unit: Unit) -> None:
        self._gathers.release(unit)

    def scatter_from(self, unit: Unit, src: int) -> None:
        """After a user modified the gathered unit on rank `src` (a data-parallel position): everyone
        takes src's values and writes its own slice back into the shard and the fp32 master."""
        if self._gathers.secondary is not None:  # kept from before the change: stale
            self._gathers.secondary.drop(unit.groups)
        for g in unit.groups:
            assert g.full is not None, "scatter_from needs the unit gathered"
            comm.broadcast(g.full, src=self.parallel.dp_src(src), group=self._group)
            lo, hi = g.layout.slice_range(0, self._rank)
            mine = g.full[lo:hi]
            for target in (g.shard, g.master if isinstance(g, TrainableGroup) else None):
                if target is not None:
                    target.copy_(mine)

    def consolidated_state_dict(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The module's full state dict on rank 0 ({} elsewhere) in the parameters' dtype, one unit gathered at a
        time (no rank holds more than one unit beyond its shards, and rank 0 the result), copied to `device`
        (None: where they live); tied weights are one tensor under each name, as in module.state_dict()."""
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
                self._gathers.release(unit)
        if self._rank != 0:
            return {}
        # Buffers and unmanaged parameters are copied here; tensor-parallel slices are joined (by the
        # first rank of each data-parallel group), recognised on the module's own tensors.
        mine = {name: copy(tensor) for name, tensor in keys.items()}
        return whole_state_dict(mine, self.parallel, device, like=keys, copied=True)

    def checkpoint_shards(self) -> list[ShardRecord]:
        """Every group's shard on this rank: fp32 masters of trainable groups, frozen shards as they are."""
        return [
            ShardRecord(g.stored(), layout_pieces(g.layout, self._rank, g.names), g.opt_group, True)
            for u in self.units
            for g in u.groups
        ]

    def destroy(self) -> None:
        """Give the module back whole (every parameter gathered into its own storage), then drop hooks, shards,
        masters and gradient buckets. With parameters on NVMe (ZeRO-Infinity) it is not given back: whole, it
        would need the full model in every rank's RAM (2.3B parameters: 9.3 GB a rank). They stay released
        (empty, ds_shape kept); save a checkpoint, consolidated_state_dict() or save_16bit_model() before."""
        if self.offload is not None:
            self.offload.finish()  # a step still running behind the forward: its error, if any, is raised here
        give_back_whole = self.offload is None or not self.offload.settings.params
        self._gathers.drop_prefetched()
        self._plan.forget()
        self.zero_grad()
        self.hooks.remove()
        if self._linear_installed:
            memory_efficient_linear.uninstall()
            self._linear_installed = False
        self._memory.close_arena()  # the module's own storage: plain allocations that outlive the stage
        for unit in self.units:
            if give_back_whole:
                self._gathers.gather(unit)
            for g in unit.groups:
                for p in g.params:
                    owners.set_unit(p, None)
                    owners.set_held(p, None)
                    if give_back_whole:
                        p.data = p.data.clone()
                        released.give_back(p)
                g.full = None
                if isinstance(g, TrainableGroup):
                    g.master.grad = None
            if give_back_whole:
                unit.move(UnitState.PARTITIONED)
        self.units.clear()
        self._norm_runs.clear()
        self._norm_runs_of.clear()
        self._grads.clear()
        self._memory.clear()
        self._gathers.gathered_bytes = 0
        comm.free_buffers()
        if self.offload is not None:
            self.offload.close()  # the swap files and folder removed
