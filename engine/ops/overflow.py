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

from collections.abc import Sequence

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
