"""The collectives in torch.distributed's own signatures, for user code (deepspeed.comm's surface).

The engine's calls (collectives.py) take flat buffers in the engine's argument order; a script written
against torch.distributed or deepspeed.comm passes lists of tensors, `group` before `async_op`, a reduce
op, all-to-all splits, picklable objects. These functions take those arguments. The sum reduce-scatters
and every all-gather run as the engine's own (collectives.py: the point-to-point schedules on gloo),
the rest as torch's, and every call is counted for comm_stats() under its op name ("<group>.<op>" on a
subgroup) with the bytes this rank sends. `src` and `dst` are global ranks, as in torch. With
async_op=True each returns a handle whose wait() finishes it (copies into a list included).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.comm import collectives
from engine.comm.collectives import REDUCE_SCATTER_FLAT, Finish, Handle, ReduceOp, Work, count_sent
from engine.comm.groups import group_rank, group_size
from engine.comm.lifecycle import get_backend, get_rank

Op = ReduceOp | ReduceOp.RedOpType


class _Each:
    """Several handles waited for as one (a coalesced call)."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def wait(self, timeout: timedelta | None = None) -> bool:
        for handle in self._handles:
            if timeout is None:
                handle.wait()
            else:
                handle.wait(timeout)
        self._handles = []
        return True


def _finish(handle: Handle | _Each, async_op: bool) -> Handle | _Each | None:
    if async_op:
        return handle
    handle.wait()
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(op: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{op}: tensors must be contiguous")
    return t.view(-1)


def _check_list(op: str, tensors: list[torch.Tensor], numel: int, group: ProcessGroup | None) -> None:
    n = group_size(group)
    if len(tensors) != n or any(t.numel() != numel for t in tensors):
        raise ValueError(
            f"{op}: expected a list of {n} tensors (one per group member) of {numel} elements each, got "
            f"{[t.numel() for t in tensors]}"
        )


# ---------------------------------------------------------------------------------------- all-gather
def _start_all_gather(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> Handle:
    return collectives.all_gather(
        _flat("all_gather_into_tensor", output), tensor.contiguous().view(-1), async_op=True, group=group
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle | _Each | None:
    """output_tensor = every member's `tensor` in group order (concatenated or stacked: any contiguous
    tensor of group size x tensor's elements)."""
    return _finish(_start_all_gather(output_tensor, tensor, group), async_op)


def allgather_fn(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle | _Each | None:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle | _Each | None:
    """tensor_list[i] = group member i's `tensor`."""
    _check_list("all_gather", tensor_list, tensor.numel(), group)
    flat = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    c = tensor.numel()

    def unpack() -> None:
        for i, out in enumerate(tensor_list):
            out.copy_(flat[i * c : (i + 1) * c].view(out.shape))

    return _finish(Finish(_start_all_gather(flat, tensor, group), unpack), async_op)


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | _Each | None:
    """all_gather_into_tensor for each (output, input) pair."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    handles = [_start_all_gather(o, i, group) for o, i in zip(output_tensors, input_tensors)]
    return _finish(_Each(handles), async_op)


# ------------------------------------------------------------------------------------ reduce-scatter
def _start_reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: Op, group: ProcessGroup | None) -> Handle:
    target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    copy_back = None if target is output else (lambda: output.copy_(target))
    if op == ReduceOp.SUM:
        started = collectives.reduce_scatter(
            target.view(-1), _flat("reduce_scatter_tensor", tensor), async_op=True, group=group
        )
    else:  # the engine's schedules sum; other ops are torch's (gloo: an all-reduce and a slice)
        factor = 2 if get_backend(group) == "gloo" else 1
        n = group_size(group)
        count_sent("reduce_scatter", _nbytes(tensor) * factor * (n - 1) // max(n, 1), group)
        started = REDUCE_SCATTER_FLAT(target, tensor, op=op, group=group, async_op=True)
    return Finish(started, copy_back)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | _Each | None:
    """output_tensor = the reduction over members of their `tensor`'s slice at this rank's group position
    (`tensor` holds group size x output_tensor's elements)."""
    return _finish(_start_reduce_scatter(output_tensor, tensor, op, group), async_op)


reduce_scatter_fn = reduce_scatter_tensor


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | _Each | None:
    """output = the reduction over members of their input_list[this rank's group position]."""
    _check_list("reduce_scatter", input_list, output.numel(), group)
    flat = torch.cat([t.reshape(-1) for t in input_list])
    return _finish(_start_reduce_scatter(output, flat, op, group), async_op)


# ------------------------------------------------------------------------------------ the rest
def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: Op = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle | _Each | None:
    """all_reduce of every tensor, as one flat all-reduce per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    handles: list[Handle] = []
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])

        def unpack(flat: torch.Tensor = flat, same: list[torch.Tensor] = same) -> None:
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()

        handles.append(Finish(collectives.all_reduce(flat, op, group, async_op=True), unpack))
    return _finish(_Each(handles), async_op)


def inference_all_reduce(
    tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> torch.Tensor:
    """all_reduce in place, always synchronous (DeepSpeed ignores async_op here); returns `tensor`."""
    if group_size(group) > 1:
        collectives.all_reduce(tensor, op, group)
    return tensor


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Member i receives the i-th piece of every member's `tensor` (dim 0 split evenly, or by
    input_split_sizes), in group order, into `output` (split by output_split_sizes)."""
    n, me = group_size(group), group_rank(group)
    rows = tensor.shape[0] if tensor.dim() else 0
    own_rows = input_split_sizes[me] if input_split_sizes else rows // max(n, 1)
    row_bytes = _nbytes(tensor) // rows if rows else 0
    count_sent("all_to_all_single", _nbytes(tensor) - own_rows * row_bytes, group)
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """output_tensor_list[i] = member i's input_tensor_list[this rank's group position]."""
    me = group_rank(group)
    count_sent("all_to_all", sum(_nbytes(t) for i, t in enumerate(input_tensor_list) if i != me), group)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: Op = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """The reduction over members of `tensor`, into `tensor` on global rank `dst`."""
    count_sent("reduce", 0 if get_rank() == dst else _nbytes(tensor), group)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """gather_list (on global rank `dst` only) = every member's `tensor`, in group order."""
    count_sent("gather", 0 if get_rank() == dst else _nbytes(tensor), group)
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """tensor = scatter_list[this rank's group position] of global rank `src` (which alone passes it)."""
    mine = group_rank(group)
    sent = sum(_nbytes(t) for i, t in enumerate(scatter_list or []) if i != mine) if get_rank() == src else 0
    count_sent("scatter", sent, group)
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def broadcast_object_list(
    object_list: list[Any], src: int, group: ProcessGroup | None = None, device: torch.device | None = None
) -> None:
    """object_list = global rank `src`'s, picklable objects (small metadata only)."""
    dist.broadcast_object_list(object_list, src, group=group, device=device)
    n = group_size(group)
    count_sent("broadcast_object_list", len(pickle.dumps(object_list)) * (n - 1) // max(n, 1), group)


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """object_list[i] = group member i's picklable `obj` (small metadata only)."""
    dist.all_gather_object(object_list, obj, group=group)
    count_sent("all_gather_object", len(pickle.dumps(obj)) * (group_size(group) - 1), group)


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not reach it within `timeout` (gloo only, torch's)."""
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def has_all_gather_into_tensor() -> bool:
    return True  # all_gather_into_tensor above, on every torch the engine supports


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True
