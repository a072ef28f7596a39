"""Cross-entropy over logits whose vocabulary (last) dimension is split across the tensor-parallel
group (Megatron's vocab_parallel_cross_entropy): the full logits are never gathered.

Per token, with this rank's slice z_r of the logits and the target t:

    m    = max over all ranks of max(z_r)        all-reduce MAX (for exp's range only: it cancels)
    S    = sum over ranks of sum(exp(z_r - m))   all-reduce SUM
    z_t  = the rank holding t contributes z_t - m, the others 0: all-reduce SUM
    loss = log(S) - (z_t - m)
    d loss / d z_r = softmax_r - onehot_r(t)     (this rank's slice; no communication backward)

S and z_t travel in one all-reduce (one latency instead of two).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.parallel.mappings import resolve_group, size_and_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        size, rank = size_and_rank(group)
        # float32 math whatever the logits' dtype: exp and the sum of a vocabulary of exps in
        # bf16 would lose the loss's digits.
        z = logits.float()
        top = z.max(dim=-1).values
        if size > 1:
            comm.all_reduce(top, op=comm.ReduceOp.MAX, group=group)
        z = z - top.unsqueeze(-1)

        width = z.shape[-1]
        start = rank * width
        outside = (target < start) | (target >= start + width)
        local_target = (target - start).masked_fill(outside, 0)
        z_2d, target_1d = z.reshape(-1, width), local_target.reshape(-1)
        rows = torch.arange(z_2d.shape[0], device=z.device)
        target_logit = z_2d[rows, target_1d].masked_fill(outside.reshape(-1), 0.0).view_as(target)

        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        if size > 1:
            comm.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = sum_exp.log() - target_logit

        exp.div_(sum_exp.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, outside, local_target)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad_2d = grad.view(-1, grad.shape[-1])
        rows = torch.arange(grad_2d.shape[0], device=grad.device)
        grad_2d[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token cross-entropy loss (shape of `target`, float32; take .mean() for F.cross_entropy's
    default) of logits split along the last dimension across the tensor-parallel group: this rank
    holds vocabulary entries [r * V/tp, (r+1) * V/tp), as a ColumnParallelLinear(gather_output=False)
    produces them. `target` holds full-vocabulary ids, the same on every rank of the group. Every id
    must be a real vocabulary entry (no ignore_index). group: default the tensor-parallel group of
    engine.parallel.initialize_model_parallel()."""
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(logits_shard, target, resolve_group(group))
    return out
