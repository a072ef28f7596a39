"""The loss of a batch cut along the sequence: each rank's mean over its labelled tokens, weighted by how
many it has, over the sequence-parallel group (what Hugging Face's deepspeed_sp_compute_loss computes).

    loss = model(**inputs).loss                                   # this rank's token mean
    loss = sequence_parallel_loss(loss, (inputs["shift_labels"] != -100).sum(), group)
    engine.backward(loss)

Every rank gets the same value: the mean over the whole sequence's labelled tokens. Its backward sends
each rank's share of the gradient back to the rank that computed that part, summed over the group (as the
backward of an all-gather does), so the gradients the engine averages over all ranks are the gradient
of the unsplit batch. Written with the engine's collectives: torch's differentiable all-gather's backward
addresses a sub-group's members by their global rank on gloo, which fails for every sequence-parallel
group but the first (sequence x data parallelism on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.comm.torch_style import all_gather


class _GatherScalars(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(value) for _ in range(comm.group_size(group))]
        all_gather(parts, value.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        comm.all_reduce(summed, group=ctx.group)  # every rank's gradient for each member's value, added
        return summed[comm.group_rank(ctx.group)], None


def sequence_parallel_loss(loss: torch.Tensor, labelled_tokens: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The token-weighted mean of every rank's `loss` (a mean over its `labelled_tokens`) over `group`; a rank
    with no labelled tokens counts for nothing (its loss may be nan)."""
    losses = _GatherScalars.apply(loss.reshape(()), group)
    counts = _GatherScalars.apply(labelled_tokens.reshape(()).to(loss.dtype).detach(), group)
    weighted = torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts
    return weighted.sum() / counts.sum().clamp(min=1)
