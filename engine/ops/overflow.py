"""The sum of squares of many tensors (for the gradient norm) and whether any element is inf/nan (for the
loss scaler), in one read of the data.

    sum_sq, overflow = sum_squares_and_overflow(grads, scale=1 / loss_scale)
    grad_norm = math.sqrt(sum_sq)

Each element contributes (float32(x) * float32(scale))^2, summed in float64; `overflow` says whether any
element x itself is inf/nan (a finite x whose scaled value overflows float32 makes the sum inf instead).
The compiled op (csrc/cpu/overflow.cpp) is bitwise deterministic at any thread count; the pure-torch path
here (no extension, or tensors not on CPU) sums in float64 with torch's own order, so the two differ by
float64 rounding only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.ops.checks import check_overflow_args
from engine.ops.select import compiled_module

_PIECE = 1 << 22
"""Elements the torch path converts to float64 at a time, to bound its temporary memory (32 MiB)."""


def sum_squares_and_overflow(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> tuple[float, bool]:
    """(sum over all elements of (float(x) * scale)^2 in float64, whether any element is inf/nan)."""
    check_overflow_args(tensors)
    ext = compiled_module(tensors)
    if ext is not None:
        total, overflow = ext.sum_squares_and_overflow(list(tensors), float(scale))
        return float(total), bool(overflow)
    return torch_sum_squares_and_overflow(tensors, scale)


def torch_sum_squares_and_overflow(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> tuple[float, bool]:
    """The pure-torch path (fallback and test reference); takes inputs sum_squares_and_overflow checked."""
    if not tensors:
        return 0.0, False
    device = tensors[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    with torch.no_grad():
        for t in tensors:
            for piece in t.reshape(-1).split(_PIECE):
                scaled = (piece.float() * scale).double()  # float32 multiply, as the compiled op does
                total += torch.dot(scaled, scaled).to(device)
                nonfinite |= ~torch.isfinite(piece).all().to(device)
    return total.item(), bool(nonfinite.item())  # one host sync per call, not per tensor


# [Note: the norm's partial sums]
# Both paths above add one partial sum per piece (the compiled op: per CHUNK elements; the torch path:
# per _PIECE), pieces never spanning two tensors, into a float64 total in order. chunk_sum_squares hands
# back those partials for some tensors, and add_in_order adds partials in that same order, so a caller
# can take each tensor's partials when the tensor is at hand (stage 3 on NVMe: a gradient as its
# reduction lands, before it goes to disk) and have, at the step, the very total sum_squares_and_overflow
# would return for the whole list, bitwise.


def chunk_sum_squares(tensors: Sequence[torch.Tensor]) -> tuple[list[float], bool]:
    """The partial sums sum_squares_and_overflow(tensors) adds up, in its order, and whether any element
    is inf/nan. CPU tensors only (the CUDA op keeps its partials on the device)."""
    check_overflow_args(tensors)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("chunk_sum_squares: the partial sums of the norm are taken on CPU tensors only")
    ext = compiled_module(tensors)
    if ext is not None:
        sums, overflow = ext.chunk_sum_squares(list(tensors))
        return sums.tolist(), overflow
    partials, overflow = [], False
    with torch.no_grad():
        for t in tensors:
            for piece in t.reshape(-1).split(_PIECE):
                scaled = piece.float().double()
                partials.append(float(torch.dot(scaled, scaled)))
                overflow = overflow or not bool(torch.isfinite(piece).all())
    return partials, overflow


def add_in_order(partials: Iterable[float]) -> float:
    """The float64 total of partial sums added one by one in order, as sum_squares_and_overflow does
    (never math.fsum or a pairwise sum: a different order rounds differently)."""
    total = 0.0
    for p in partials:
        total += p
    return total


@dataclass(frozen=True)
class KnownSquares:
    """The norm's partial sums of some tensors, taken earlier (chunk_sum_squares), standing in for them."""

    partials: list[float]
    overflow: bool


def sum_squares_of(rows: Sequence[torch.Tensor | KnownSquares]) -> tuple[float, bool]:
    """sum_squares_and_overflow of the tensors `rows` stands for, bitwise, where some are KnownSquares
    (see [Note: the norm's partial sums]); runs of tensors between them are summed here, on CPU."""
    if all(isinstance(r, torch.Tensor) for r in rows):
        return sum_squares_and_overflow(rows)  # type: ignore[arg-type]
    partials: list[float] = []
    overflow = False
    run: list[torch.Tensor] = []
    for r in [*rows, None]:
        if isinstance(r, torch.Tensor):
            run.append(r)
            continue
        if run:
            sums, bad = chunk_sum_squares(run)
            partials += sums
            overflow = overflow or bad
            run = []
        if r is not None:
            partials += r.partials
            overflow = overflow or r.overflow
    return add_in_order(partials), overflow
