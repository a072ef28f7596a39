"""Add one 1-D segment into an accumulator in place, widening, scaling and summing in float32, in one pass.

    accumulate(dst, src, scale=1.0)   # dst += float32(src) * scale

The gloo reduce-scatter (engine/comm/p2p.py) adds each arriving bfloat16/float16 segment into a float32
output this way, with no float32 copy of the segment. The compiled op (csrc/cpu/accumulate.cpp on CPU,
csrc/cuda/accumulate.cuh on a GPU) is one pass over both tensors; the pure-torch path here is its fallback
(no extension) and its reference in the tests.

Pairs (dst, src): float32 with float32, bfloat16 or float16; bfloat16 with bfloat16; float16 with float16.
Both 1-D, contiguous, on the same device, with the same numel; they may be the same tensor, but may not
partially overlap.

# [Note: accumulate semantics]
# Every element becomes to_dst(float32(dst) + float32(src) * float32(scale)), in float32 math with a
# rounding after each operation: the product is rounded to float32 on its own (no fused multiply-add;
# torch's `src.float() * scale`), the sum is a float32 sum, and for a bfloat16/float16 dst that float32
# sum is rounded once to dst's dtype, to nearest even (torch's casts). scale == 1.0 skips the multiply
# (it is exact either way). Both paths follow this, so their results are bitwise equal (NaN payloads
# aside), at any thread count.
"""

from __future__ import annotations

import torch

from engine.ops.checks import check_accumulate_args
from engine.ops.select import compiled_module


def accumulate(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
    """dst += float32(src) * scale, in place. See [Note: accumulate semantics] for the exact rounding."""
    check_accumulate_args(dst, src)
    ext = compiled_module([dst, src])
    if ext is not None:
        ext.accumulate(dst, src, float(scale))
    else:
        torch_accumulate(dst, src, scale)


def torch_accumulate(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
    """The pure-torch accumulate (fallback and test reference); takes inputs accumulate has checked."""
    with torch.no_grad():  # the compiled op bypasses autograd too
        # See [Note: accumulate semantics]. float32(src) * 1.0 is float32(src) itself: mixed-dtype add_
        # widens a bfloat16/float16 src exactly, so no temporary is needed for an unscaled call.
        addend = src if scale == 1.0 else src.float() * scale  # a float32 product, rounded on its own
        if dst.dtype == torch.float32:
            dst.add_(addend)
        else:
            dst.copy_(dst.float().add_(addend))  # float32 sum, then one round-to-nearest-even into dst
