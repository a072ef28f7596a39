"""Stage 0: replicated parameters and optimizer, gradients all-reduced in buckets (DDP-equivalent).

The same flat layout as every stage (engine/zero/layout.py), with one slice per bucket that every
rank keeps: gradients accumulate in a full-size flat buffer and each bucket is all-reduced during
the boundary backward (engine/zero/flat/boundary_reduced.py). The optimizer sees one fp32 master per
parameter, a view into the group's flat master (in fp32 the parameters' own storage), with its
gradient a view into the gradient rows (in the accumulation dtype; engine/zero/master_step.py steps
them): so any torch optimizer runs unchanged, per-tensor ones included (LAMB's trust ratio is per
parameter), in fp32, bf16 and fp16. bf16/fp16 parameters are written from the masters by the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config.types import EngineConfig
from engine.zero.flat.boundary_reduced import BoundaryReducedStage
from engine.zero.flat.bucket import Bucket
from engine.zero.flat_groups import FlatGroup, bind_optimizer_per_parameter
from engine.zero.fragments import HeldGroup
from engine.zero.layout import Piece
from engine.zero.records import NamedPiece, ShardRecord


class Stage0(BoundaryReducedStage):
    stage = 0
    partitioned = False

    def _bind_optimizer(self, config: EngineConfig) -> None:
        self._masters, self.master_step = bind_optimizer_per_parameter(self.optimizer, self.groups, config)

    # Late gradients (stage.py's Note) are refused here, as DDP refuses them: reducing them needs
    # every rank to agree on which buckets have any, one more collective per step, and stage 0 moves
    # exactly the 2 Psi bytes of DDP's all-reduce per step and nothing else.
    def _add_late(self, bk: Bucket, i: int, grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"a gradient of parameter {bk.group.names[i]!r} {tuple(grad.shape)} arrived twice in one backward at an "
            "accumulation boundary, after its bucket was already sent for reduction (reentrant activation "
            "checkpointing or a second backward over the same graph). Run the extra backward on a non-boundary "
            "micro-step, use non-reentrant checkpointing, or use zero_optimization.stage 1 or 2, which reduce "
            "such late gradients at the step"
        )

    def _reduce_late(self) -> None:
        pass  # none accepted

    def _held_groups(self) -> list[HeldGroup]:
        """One group per parameter: its master view, which the optimizer steps, and its gradient view."""
        held = []
        for g, masters in zip(self.groups, self._masters):
            grads = g.shard_grad.view(-1)
            for i, (p, master) in enumerate(zip(g.params, masters)):
                span = g.layout.params[i]
                held.append(
                    HeldGroup(
                        params=[p],
                        names=[g.names[i]],
                        shapes=[tuple(p.shape)],
                        pieces=[Piece(0, 0, 0, span.numel)],
                        master=master,
                        grad=grads[span.offset : span.end],
                        grad_ready=g.grads_reduced,
                        write_whole=_writer(g, i),
                    )
                )
        return held

    def checkpoint_shards(self) -> list[ShardRecord]:
        """One record per parameter (the optimizer's state is per parameter); the first rank of each
        data-parallel group writes (rank 0 without tensor parallelism), as its members hold the same values."""
        write = self.parallel.dp_rank == 0
        return [
            ShardRecord(master, [NamedPiece(name, 0, 0, master.numel())], g.opt_group, write)
            for g, masters in zip(self.groups, self._masters)
            for master, name in zip(masters, g.names)
        ]


def _writer(g: FlatGroup, i: int) -> Callable[[int, torch.Tensor], None]:
    """HeldGroup.write_whole of a one-parameter group: parameter i of the flat group `g`."""

    def write(_: int, value: torch.Tensor) -> None:
        g.write_whole(i, value)

    return write
