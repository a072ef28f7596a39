"""The data of the swapped step ([Note: the swapped step] in engine/offload/optimizer_swap.py): where each
master's sub-groups lie in its swap files, the swapped state of one master, and one sub-group's job in
one step. Pure bookkeeping: no transfer starts here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from engine.offload.mapped_file import MappedFile
from engine.offload.swap_file import SwapFile
from engine.ops.adam import AdamScalars
from engine.ops.aio import DIRECT_ALIGN
from engine.ops.flatten import contiguous_pieces

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The Adam moments every swapped master keeps in files, under torch's AdamW keys."""


class SwapTarget(Protocol):
    """One tensor the optimizer steps (engine/zero/master_step.py's MasterTarget)."""

    master: torch.Tensor
    """fp32: a shard, a (buckets, slice) view of one, or a parameter's view."""
    grad: torch.Tensor
    """Same shape, in the accumulation dtype."""
    lp: torch.Tensor | None
    """The low-precision parameter storage the step writes, or None."""


def sub_group_cuts(piece_numels: list[int], sub_group_size: int) -> list[tuple[int, int, int, int]]:
    """The sub-groups of a target laid out as pieces end to end in its swap files: (piece, lo, n, file
    offset) each, in file order, covering every element once, each at most sub_group_size elements.
    A cut falls at every file offset that is a multiple of the step (sub_group_size rounded down to a
    multiple of 4 KiB of fp32 elements, when it is at least that), and at piece boundaries: every
    sub-group that does not start a piece then starts on the 4 KiB grid, and each whole step of them
    is a whole number of 4 KiB blocks."""
    grid = DIRECT_ALIGN // 4  # fp32 elements per 4 KiB
    step = sub_group_size - sub_group_size % grid if sub_group_size >= grid else sub_group_size
    cuts, offset = [], 0
    for piece, numel in enumerate(piece_numels):
        lo = 0
        while lo < numel:
            n = min(step - offset % step, numel - lo)
            cuts.append((piece, lo, n, offset))
            lo += n
            offset += n
    return cuts


class Part(NamedTuple):
    """One sub-group: elements [lo, lo + n) of a target's pieces laid end to end."""

    target: int
    master: torch.Tensor | None
    """The master's elements (a view); None when the master is swapped (its buffer holds them)."""
    grad: torch.Tensor
    lp: torch.Tensor | None
    offset: int


@dataclass
class Swapped:
    master: torch.Tensor
    shape: torch.Size
    files: dict[str, SwapFile]
    """exp_avg, exp_avg_sq, and "master" when the master is swapped."""
    parts: list[Part]
    state: dict[str, Any]
    grad_file: MappedFile | None
    """The mapped swap file holding the gradient (NvmeSettings.grads), else None."""


def grad_buffer(buffers: dict[str, torch.Tensor], part: Part) -> torch.Tensor:
    """The sub-group buffer a part's gradient is read into, in the gradient's dtype."""
    nbytes = part.grad.numel() * part.grad.element_size()
    return buffers["grad"].view(torch.uint8)[:nbytes].view(part.grad.dtype)


class Job(NamedTuple):
    """One sub-group of one step, with that step's scalars."""

    swapped: Swapped
    part: Part
    scalars: AdamScalars


def swapped_target(
    index: int,
    target: SwapTarget,
    files: dict[str, SwapFile],
    optimizer_state: dict[str, Any],
    grad_file: MappedFile | None,
    sub_group_size: int,
) -> Swapped:
    """Target `index`'s swapped state: its sub-groups over `files` (exp_avg, exp_avg_sq, and "master"
    when the master is swapped: then its parts hold no master view, the buffer has it)."""
    lp = [target.lp] if target.lp is not None else []
    master, grad, *lp_lists = contiguous_pieces([target.master, target.grad, *lp])
    lp_pieces = lp_lists[0] if lp_lists else None
    swap_master = "master" in files
    parts = [
        Part(
            index,
            None if swap_master else master[j][lo : lo + n],
            grad[j][lo : lo + n],
            lp_pieces[j][lo : lo + n] if lp_pieces is not None else None,
            offset,
        )
        for j, lo, n, offset in sub_group_cuts([m.numel() for m in master], sub_group_size)
    ]
    optimizer_state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
    return Swapped(target.master, target.master.shape, files, parts, optimizer_state, grad_file)
