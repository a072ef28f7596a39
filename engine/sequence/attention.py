"""`DistributedAttention`: any local attention made sequence-parallel with two all-to-alls (Megatron-
DeepSpeed's API, `deepspeed.sequence.layer.DistributedAttention`).

    attention = DistributedAttention(local_attention, sequence_group)   # Megatron's [s, b, h, d] layout
    out = attention(q, k, v, batch_dim_idx=1)       # q, k, v: [s/p, b, h, d] -> out: [s/p, b, h, d]

Before the local attention, q, k and v trade their sequence split (`gather_idx`) for a split of the
heads (`scatter_idx`): each rank then holds every token of h/p heads, which is all attention needs. After
it, the output trades back. Heads must divide by the group's size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.comm import ProcessGroup
from engine.sequence.all_to_all import seq_all_to_all


class DistributedAttention(torch.nn.Module):
    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: ProcessGroup,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        """The heads' dimension: split over the group while attention runs."""
        self.gather_idx = gather_idx
        """The sequence's dimension: split over the group outside attention."""
        del sp_stream  # DeepSpeed's CUDA side stream for overlapping the exchanges; the exchanges run in order here

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int | None = None,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        del batch_dim_idx  # the exchanges address scatter_idx and gather_idx directly, whatever the batch's dim
        if rotary_pos_emb is not None:
            raise NotImplementedError(
                "DistributedAttention(rotary_pos_emb=...): apply the rotary embedding to q and k before the call "
                "(with each token's global position, as the local slice has them)"
            )
        q, k, v = (seq_all_to_all(t, self.scatter_idx, self.gather_idx, self.spg) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.gather_idx, self.scatter_idx, self.spg)
