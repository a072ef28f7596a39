"""Many tensors into / out of ranges of one flat 1-D buffer, with a dtype cast and a scale, in one call.

    copy_into(flat, grads, offsets, scale=1 / loss_scale)   # flat[off_i : off_i + n_i] = grads[i] * scale
    copy_out(flat, params_lp, offsets)                      # params_lp[i] = flat[off_i : off_i + n_i]

The compiled op (csrc/cpu/flatten.cpp on CPU, one multi-tensor launch from csrc/cuda on a GPU) does all
tensors in one pass; the pure-torch path here is its fallback (no extension, mixed devices) and its
reference in the tests.

# [Note: copy semantics]
# Every element becomes cast_to_out_dtype(float32(in) * float32(scale)): the multiply is float32 math
# (torch's own for a float32 tensor times a Python float) and casts round to nearest even. scale == 1.0
# is a pure copy/cast. Both paths follow this, so their results are bitwise equal (NaN payloads aside).
# Ranges of `dst` given to one copy_into must not overlap (the chunks are written in parallel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.ops.checks import check_copy_args
from engine.ops.select import compiled_module


def copy_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """dst[offsets[i] : offsets[i] + srcs[i].numel()] = cast(srcs[i] * scale) for every i.

    See [Note: copy semantics]. dst is 1-D and contiguous, every source contiguous; dtypes float32,
    bfloat16, float16 in any combination.
    """
    check_copy_args("copy_into", dst, "dst", srcs, "srcs", offsets)
    ext = compiled_module([dst, *srcs])
    if ext is not None:
        ext.copy_into(dst, list(srcs), [int(o) for o in offsets], float(scale))
    else:
        torch_copy_into(dst, srcs, offsets, scale)


def copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """dsts[i] = cast(src[offsets[i] : offsets[i] + dsts[i].numel()] * scale) for every i (any shapes).

    See [Note: copy semantics]. src is 1-D and contiguous, every destination contiguous.
    """
    check_copy_args("copy_out", src, "src", dsts, "dsts", offsets)
    ext = compiled_module([src, *dsts])
    if ext is not None:
        ext.copy_out(src, list(dsts), [int(o) for o in offsets], float(scale))
    else:
        torch_copy_out(src, dsts, offsets, scale)


def torch_copy_into(
    dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0
) -> None:
    """The pure-torch copy_into (fallback and test reference); takes inputs copy_into has checked."""
    with torch.no_grad():  # the compiled op bypasses autograd too
        for src, offset in zip(srcs, offsets):
            _copy(dst[offset : offset + src.numel()], src.reshape(-1), scale)


def torch_copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """The pure-torch copy_out (fallback and test reference); takes inputs copy_out has checked."""
    with torch.no_grad():
        for dst, offset in zip(dsts, offsets):
            _copy(dst.view(-1), src[offset : offset + dst.numel()], scale)


def _copy(out: torch.Tensor, inp: torch.Tensor, scale: float) -> None:
    # See [Note: copy semantics]: both branches multiply in float32 and round once into `out`.
    if scale == 1.0:
        out.copy_(inp)
    elif out.dtype == torch.float32:
        out.copy_(inp).mul_(scale)
    else:
        out.copy_(inp.float() * scale)  # out of place: inp.float() is inp itself for a float32 input


def contiguous_pieces(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors of one shape as contiguous 1-D pieces, split alike and without copying: each whole, or
    row by row when one is a shard's strided (num_buckets, slice) view of a flat buffer."""
    if all(t.is_contiguous() for t in tensors):
        return [[t.reshape(-1)] for t in tensors]
    if all(t.dim() == 2 and t.stride(1) == 1 for t in tensors):
        return [list(t.unbind(0)) for t in tensors]
    raise ValueError(
        f"tensors of shape {tuple(tensors[0].shape)} and strides {[t.stride() for t in tensors]} have "
        "no contiguous rows"
    )
