"""Megatron's region boundaries (its mappings.py) as autograd functions: copy / reduce / gather / scatter
between a tensor-parallel region and the replicated code around it, and the group a layer works in.
engine/parallel/layers.py builds the tensor-parallel layers from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.config.errors import ConfigError
from engine.parallel.groups import get_tensor_model_parallel_group


# ------------------------------------------------------------------ the group a layer works in
def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """`group`, or the tensor-parallel group of engine.parallel.initialize_model_parallel() when None.
    The result is None when the tensor-parallel size is 1 (every boundary is then the identity)."""
    return get_tensor_model_parallel_group() if group is None else group


def size_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    """(tensor-parallel size, this rank's position) of a resolved group (None: size 1)."""
    return (1, 0) if group is None else (comm.group_size(group), comm.group_rank(group))


def check_divisible(what: str, value: int, tp_size: int) -> int:
    """value // tp_size, or a ConfigError naming both numbers."""
    if value % tp_size:
        raise ConfigError(
            f"{what} {value} is not divisible by the tensor-parallel size {tp_size}; make it a "
            f"multiple of {tp_size} or use a tensor_model_parallel_size that divides it"
        )
    return value // tp_size


# ------------------------------------------------------------------ region boundaries (Megatron's mappings.py)
def _all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # Into a fresh buffer: the input may be an autograd-saved tensor or a gradient another
    # consumer shares, and reducing it in place would change their values.
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def _own_slice(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size, rank = size_and_rank(group)
    width = check_divisible("the last dimension", x.shape[-1], size)
    return x.narrow(-1, rank * width, width).contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return torch.cat(comm.all_gather_list(x.contiguous(), group=group), dim=-1)


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.view_as(x)  # a view: autograd.Function must not return its input itself


Boundary = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]


class _Region(torch.autograd.Function):
    """One region boundary: `forward` on the way in, its adjoint `backward` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, forward: Boundary, backward: Boundary) -> torch.Tensor:
        ctx.group, ctx.backward = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward(grad, ctx.group), None, None, None


# Opaque to torch.compile: in a compiled model the graph breaks at each region boundary and its collective
# runs through engine.comm as written (traced, Dynamo would guard on comm's counters and recompile at every
# call); the matrix products between the boundaries are compiled (docs/compile.md).
@torch.compiler.disable
def _apply(forward: Boundary, backward: Boundary, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    resolved = resolve_group(group)
    if resolved is None or comm.group_size(resolved) == 1:
        return x
    out: torch.Tensor = _Region.apply(x, resolved, forward, backward)
    return out


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter a parallel region with a replicated input: identity forward, all-reduce (sum) of the
    gradient backward (each rank's slice contributes to the input's gradient).
    Megatron: copy_to_tensor_model_parallel_region."""
    return _apply(_identity, _all_reduce_sum, x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave a parallel region by summing the ranks' partial results: all-reduce forward, identity
    backward. Megatron: reduce_from_tensor_model_parallel_region."""
    return _apply(_all_reduce_sum, _identity, x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave a parallel region by concatenating the ranks' slices of the last dimension (group order):
    all-gather forward, this rank's slice of the gradient backward.
    Megatron: gather_from_tensor_model_parallel_region."""
    return _apply(_gather_last, _own_slice, x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter a parallel region by keeping this rank's slice of the last dimension: slice forward,
    all-gather of the gradient backward. Megatron: scatter_to_tensor_model_parallel_region."""
    return _apply(_own_slice, _gather_last, x, group)
