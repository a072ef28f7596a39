"""Whole tensors from tensor-parallel slices: the model's full state dict on rank 0 when each
tensor-parallel rank holds a slice of some parameters.

A tensor-parallel parameter carries Megatron's `partition_dim` and `partition_stride`: rank r holds
slice r along partition_dim, or with stride s (a fused layer such as q, k and v stacked in one
weight) s chunks, chunk c of rank r being part r of the whole's chunk c. Joining is the inverse:
for each chunk, the ranks' parts in rank order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine import comm
from engine.parallel.groups import ParallelGroups
from engine.parallel.layers import is_tensor_parallel
from engine.zero.clone import clone_tensors_for_torch_save


def join_slices(
    slices: Sequence[torch.Tensor], dim: int, stride: int = 1, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's slice, in rank order. Each slice holds its
    share of consecutive parts along `dim`, which are joined one by one: `stride` equal parts (1: the
    slices are simply concatenated), or `sections`, the whole sizes of unequal parts (a fused [q; k; v]
    with fewer key/value heads, as DeepSpeed cuts it)."""
    shares = [w // len(slices) for w in sections] if sections is not None else [slices[0].shape[dim] // stride] * stride
    pieces = [s.split(shares, dim=dim) for s in slices]
    return torch.cat([part[j] for j in range(len(shares)) for part in pieces], dim=dim)


def split_slice(whole: torch.Tensor, rank: int, size: int, dim: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `whole` (join_slices' inverse)."""
    if stride == 1:
        return whole.chunk(size, dim=dim)[rank]
    return torch.cat([chunk.chunk(size, dim=dim)[rank] for chunk in whole.chunk(stride, dim=dim)], dim=dim)


def whole_state_dict(
    state: Mapping[str, torch.Tensor],
    parallel: ParallelGroups,
    device: torch.device | None,
    *,
    like: Mapping[str, torch.Tensor] | None = None,
    copied: bool = False,
) -> dict[str, torch.Tensor]:
    """`state` (this rank's) with tensor-parallel slices joined, on global rank 0; {} elsewhere. Every rank
    calls it; the ranks of data-parallel position 0 (rank 0's tensor-parallel group) gather.

    Tensor-parallel tensors are recognised by Megatron's attributes on `like[name]` (the module's own
    tensors, state_dict(keep_vars=True)), or on `state`'s own tensors when `like` is None. The result
    is copied to `device`, unless `copied`: `state` holds copies on `device` already."""
    if parallel.dp_rank != 0:
        return {}
    marked = like if like is not None else state
    if parallel.tp_size > 1:
        joined: dict[int, torch.Tensor] = {}  # a tensor under several names is joined once
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            attrs = marked[name]
            if is_tensor_parallel(attrs):
                if id(tensor) not in joined:
                    parts = comm.all_gather_list(tensor.detach(), group=parallel.tp_group)
                    joined[id(tensor)] = join_slices(
                        parts, int(getattr(attrs, "partition_dim", 0)), int(getattr(attrs, "partition_stride", 1))
                    )
                out[name] = joined[id(tensor)]
            else:
                out[name] = tensor
        state = out
    if comm.get_rank() != 0:
        return {}
    return dict(state) if copied else clone_tensors_for_torch_save(dict(state), device)
