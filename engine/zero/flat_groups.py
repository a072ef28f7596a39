"""Flat parameter groups: the model's parameters moved into flat buffers, and the optimizer rebound
to their fp32 masters (engine/zero/layout.py's Note explains the layout).

Used by the flat stages: 1 and 2 with one slice per rank, 0 with one slice that every rank keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.offload.nvme_setup import nvme_settings
from engine.ops.flatten import copy_into
from engine.zero.fragments import HeldGroup
from engine.zero.layout import GroupLayout, build_layout
from engine.zero.master_step import MasterStep, MasterTarget, offload_enabled

logger = get_logger()


@dataclass
class FlatGroup:
    """One optimizer param group's parameters of one dtype, laid out flat."""

    index: int
    """Position among all flat groups."""
    opt_group: int
    """Index of the optimizer param group it belongs to."""
    params: list[torch.nn.Parameter]
    """In arrival order (the layout's order)."""
    names: list[str]
    layout: GroupLayout
    rank: int
    """Which slice of every bucket this rank owns (0 when not partitioned)."""
    flat: torch.Tensor
    """Padded flat parameter buffer; each param's .data is a view into it."""
    master: torch.Tensor
    """(num_buckets, slice_numel) fp32: the optimizer's parameter. A strided view of `flat` for
    fp32 groups (the shard is the master), a separate contiguous buffer otherwise."""
    shard_grad: torch.Tensor
    """(num_buckets, slice_numel) in the accumulation dtype: the reduced gradient of this rank's shard.
    Its own buffer at stage 2; at stages 0-1 a view of the full accumulation buffer."""
    grad_written: list[bool] = field(default_factory=list)
    """Per bucket: shard_grad row holds this window's gradient (else it is stale)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def owns_master(self) -> bool:
        """fp32 groups are their own master; other dtypes keep a separate fp32 copy of the shard."""
        return self.dtype != torch.float32

    def shard_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slices of a flat (padded_numel) buffer as one (num_buckets, slice) view."""
        lay = self.layout
        return buffer.as_strided(
            (lay.num_buckets, lay.slice_numel),
            (lay.bucket_numel, 1),
            buffer.storage_offset() + self.rank * lay.slice_numel,
        )

    def bucket(self, buffer: torch.Tensor, b: int) -> torch.Tensor:
        start, end = self.layout.bucket_range(b)
        return buffer[start:end]

    def write_whole(self, i: int, value: torch.Tensor) -> None:
        """Parameter i takes a new whole value (every rank keeps whole parameters; in fp32 this is also the
        master)."""
        span = self.layout.params[i]
        self.flat[span.offset : span.end].copy_(value.reshape(-1))

    def grads_reduced(self) -> bool:
        """A reduction of this window landed in the gradient rows (all buckets reduce together)."""
        return any(self.grad_written)

    def held(self) -> HeldGroup:
        """The group as this rank holds it, for DeepSpeed's tensor-fragment functions (engine/zero/fragments.py)."""
        return HeldGroup(
            params=self.params,
            names=self.names,
            shapes=[tuple(p.shape) for p in self.params],
            pieces=self.layout.rank_pieces(self.rank),
            master=self.master,
            grad=self.shard_grad,
            grad_ready=self.grads_reduced,
            write_whole=self.write_whole,
        )

    def refresh_params(self) -> None:
        """Write the updated master shard into this rank's slices of the parameter buffer: every
        bucket's row cast to the parameter dtype in one parallel pass (engine/ops/flatten.py)."""
        if self.owns_master:
            lay = self.layout
            copy_into(
                self.flat,
                list(self.master.unbind(0)),
                [lay.bucket_range(b)[0] + self.rank * lay.slice_numel for b in range(lay.num_buckets)],
            )


def refresh_params(groups: list[FlatGroup]) -> None:
    """The plain optimizer step's last part: every group's low-precision parameters from its masters."""
    for g in groups:
        g.refresh_params()


def arrival_order(module: torch.nn.Module) -> dict[int, int]:
    """id(param) -> position in the order gradients are expected (reverse of registration)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return {id(p): i for i, p in enumerate(reversed(trainable))}


def build_flat_groups(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world_size: int, rank: int, bucket_size: int
) -> list[FlatGroup]:
    """Move every trainable parameter of the optimizer into flat buffers (in arrival order), one group per
    optimizer param group and dtype, each with an fp32 master of this rank's shard (the stage gives
    each its gradient shard)."""
    order = arrival_order(module)
    names = {id(p): n for n, p in module.named_parameters()}
    groups: list[FlatGroup] = []
    for gi, opt_group in enumerate(optimizer.param_groups):
        params = sorted((p for p in opt_group["params"] if p.requires_grad), key=lambda p: order[id(p)])
        for dtype in dict.fromkeys(p.dtype for p in params):
            members = [p for p in params if p.dtype == dtype]
            groups.append(
                _flatten(
                    len(groups),
                    gi,
                    members,
                    [names.get(id(p), "?") for p in members],
                    world_size=world_size,
                    rank=rank,
                    bucket_size=bucket_size,
                )
            )
    return groups


def bind_optimizer_to_shards(
    optimizer: torch.optim.Optimizer, groups: list[FlatGroup], config: EngineConfig
) -> MasterStep:
    """Stages 1-2: each optimizer param group steps its flat groups' fp32 shards (engine.initialize
    checks that the optimizer is elementwise: config/run_checks.py). The step writes each updated
    shard into this rank's slices of the low-precision parameter buffer (engine/zero/master_step.py)."""
    bind_shards(
        optimizer, [[g.master for g in groups if g.opt_group == gi] for gi in range(len(optimizer.param_groups))]
    )
    return MasterStep(
        optimizer,
        [MasterTarget(g.master, g.shard_grad, g.shard_view(g.flat) if g.owns_master else None) for g in groups],
        offload=offload_enabled(config),
        refresh=lambda: refresh_params(groups),
        nvme=nvme_settings(config),
    )


def bind_optimizer_per_parameter(
    optimizer: torch.optim.Optimizer, groups: list[FlatGroup], config: EngineConfig
) -> tuple[list[list[torch.Tensor]], MasterStep]:
    """Stage 0: each optimizer param group steps one fp32 master view per parameter (its gradient a view
    of the gradient rows), so per-tensor optimizers (LAMB's trust ratio) see each tensor whole. Needs
    groups laid out with one slice per bucket (every rank holds the whole master). Returns each
    group's master views, in the order of its parameters, and the step over them."""
    per_group: list[list[torch.Tensor]] = []
    view_of: dict[int, torch.Tensor] = {}
    targets: list[MasterTarget] = []
    for g in groups:
        assert g.layout.world_size == 1, "per-parameter masters need the whole group on this rank"
        master, grads, flat = g.master.view(-1), g.shard_grad.view(-1), g.flat.view(-1)
        views = []
        for p, span in zip(g.params, g.layout.params):
            view = master[span.offset : span.end].view(p.shape)
            targets.append(
                MasterTarget(
                    view,
                    grads[span.offset : span.end].view(p.shape),
                    flat[span.offset : span.end].view(p.shape) if g.owns_master else None,
                )
            )
            views.append(view)
            view_of[id(p)] = view
        per_group.append(views)
    # In each param group the user's order (optimizer.param_groups[i]["params"][k] is the k-th they passed).
    bind_shards(
        optimizer, [[view_of[id(p)] for p in group["params"] if id(p) in view_of] for group in optimizer.param_groups]
    )
    return per_group, MasterStep(
        optimizer,
        targets,
        offload=offload_enabled(config),
        refresh=lambda: refresh_params(groups),
        nvme=nvme_settings(config),
    )


def bind_shards(optimizer: torch.optim.Optimizer, shards: list[list[torch.Tensor]]) -> None:
    """Point each param group of `optimizer` at its fp32 shards, in place (a scheduler bound to the
    optimizer keeps working), with no state yet. Every partitioned stage binds its shards here.

    `fused=True` groups whose shards are strided views run without the fused kernel: an fp32 shard
    of stages 1-2 is a (num_buckets, slice) view of the flat parameter buffer, strided whenever there
    are several buckets and ranks, and torch's fused CPU Adam/AdamW kernels assume contiguous
    parameters: they wrote past each row into the neighbouring ranks' slices (torch 2.13: every weight of one
    rank's half of the shard off by one Adam step after one HF Trainer step, Trainer's default
    optimizer being AdamW(fused=True)). Such groups run torch's per-tensor path (same update, to
    rounding); a copy to make the shard contiguous would cost another 4 bytes per shard element."""
    for group, params in zip(optimizer.param_groups, shards, strict=True):
        group["params"] = params
    optimizer.state.clear()
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("fused") and not all(p.is_contiguous() for p in group["params"]):
            group["fused"] = False
            logger.info(
                "optimizer param group %d: fused=True turned off (its shard is a strided view of the "
                "flat buffer, which torch's fused kernels mis-handle); torch's per-tensor path runs it",
                gi,
            )


def _flatten(
    index: int,
    opt_group: int,
    params: list[torch.nn.Parameter],
    names: list[str],
    *,
    world_size: int,
    rank: int,
    bucket_size: int,
) -> FlatGroup:
    dtype, device = params[0].dtype, params[0].device
    layout = build_layout(
        [p.shape for p in params], world_size=world_size, bucket_size=bucket_size, element_size=params[0].element_size()
    )
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for p, span in zip(params, layout.params):
            view = flat[span.offset : span.end].view_as(p)
            view.copy_(p.data)
            p.data = view
    group = FlatGroup(
        index,
        opt_group,
        params,
        names,
        layout,
        rank,
        flat,
        master=flat,  # placeholder, set below
        shard_grad=torch.empty(0, device=device),  # the stage's _allocate_gradients sets it
        grad_written=[False] * layout.num_buckets,
    )
    mine = group.shard_view(flat)
    group.master = mine if dtype == torch.float32 else mine.to(torch.float32).contiguous()
    return group
