"""The all-to-all of sequence parallelism, differentiable: a tensor split along one dimension over the
ranks of a group becomes split along another.

    x: [.., s/p (gather_dim), .., h (scatter_dim), ..]  ->  [.., s (gather_dim), .., h/p (scatter_dim), ..]

Each rank cuts its `scatter_dim` into p chunks, sends chunk j to rank j, and lays the chunks it receives
side by side along `gather_dim` in rank order. The backward is the same exchange with the two
dimensions swapped (an all-to-all is a permutation of the data: its adjoint is its inverse).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
    p = comm.group_size(group)
    if p == 1:
        return x
    if x.shape[scatter_dim] % p:
        raise ValueError(
            f"sequence parallelism: dimension {scatter_dim} of a tensor of shape {tuple(x.shape)} is split over "
            f"{p} ranks, and {x.shape[scatter_dim]} is not divisible by {p}"
        )
    # [p, ...chunk]: chunk j of scatter_dim first, contiguous, so one all_to_all_single moves them all.
    chunks = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()
    received = torch.empty_like(chunks)
    comm.all_to_all_single(received, chunks, group=group)
    # received[j] is rank j's slice along gather_dim: lay them side by side.
    return torch.cat(received.unbind(0), dim=gather_dim).contiguous()


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


@torch.compiler.disable  # a graph break in a compiled model, as the tensor-parallel boundaries (mappings.py)
def seq_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
    """`x` split along `gather_dim` over `group` -> split along `scatter_dim` (see the module docstring)."""
    out: torch.Tensor = _SeqAllToAll.apply(x, scatter_dim, gather_dim, group)
    return out
