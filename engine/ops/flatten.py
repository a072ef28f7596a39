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

from engine.ops.select import compiled_module

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def copy_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """dst[offsets[i] : offsets[i] + srcs[i].numel()] = cast(srcs[i] * scale) for every i.

    See [Note: copy semantics]. dst is 1-D and contiguous, every source contiguous; dtypes float32,
    bfloat16, float16 in any combination.
    """
    check_args("copy_into", dst, "dst", srcs, "srcs", offsets)
    ext = compiled_module([dst, *srcs])
    if ext is not None:
        ext.copy_into(dst, list(srcs), [int(o) for o in offsets], float(scale))
    else:
        torch_copy_into(dst, srcs, offsets, scale)


def copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """dsts[i] = cast(src[offsets[i] : offsets[i] + dsts[i].numel()] * scale) for every i (any shapes).

    See [Note: copy semantics]. src is 1-D and contiguous, every destination contiguous.
    """
    check_args("copy_out", src, "src", dsts, "dsts", offsets)
    ext = compiled_module([src, *dsts])
    if ext is not None:
        ext.copy_out(src, list(dsts), [int(o) for o in offsets], float(scale))
    else:
        torch_copy_out(src, dsts, offsets, scale)


def torch_copy_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int],
                    scale: float = 1.0) -> None:
    """The pure-torch copy_into (fallback and test reference); takes inputs copy_into has checked."""
    with torch.no_grad():  # the compiled op bypasses autograd too
        for src, offset in zip(srcs, offsets):
            _copy(dst[offset:offset + src.numel()], src.reshape(-1), scale)


def torch_copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int],
                   scale: float = 1.0) -> None:
    """The pure-torch copy_out (fallback and test reference); takes inputs copy_out has checked."""
    with torch.no_grad():
        for dst, offset in zip(dsts, offsets):
            _copy(dst.view(-1), src[offset:offset + dst.numel()], scale)


def _copy(out: torch.Tensor, inp: torch.Tensor, scale: float) -> None:
    # See [Note: copy semantics]: both branches multiply in float32 and round once into `out`.
    if scale == 1.0:
        out.copy_(inp)
    elif out.dtype == torch.float32:
        out.copy_(inp).mul_(scale)
    else:
        out.copy_(inp.float() * scale)  # out of place: inp.float() is inp itself for a float32 input


def check_args(op: str, flat: torch.Tensor, flat_name: str, many: Sequence[torch.Tensor], many_name: str,
               offsets: Sequence[int]) -> None:
    """copy_into's / copy_out's checks of every tensor and range (named TypeError/ValueError), also the
    compiled binding's (engine/ops/cpu_lib.py)."""
    check_tensor(op, flat, flat_name)
    if flat.dim() != 1:
        raise ValueError(f"{op}: {flat_name} must be 1-D, got shape {tuple(flat.shape)}; pass a flat buffer "
                         f"(.view(-1) of a contiguous tensor)")
    if len(many) != len(offsets):
        raise ValueError(f"{op}: len({many_name}) = {len(many)} != len(offsets) = {len(offsets)}; give one "
                         f"offset per tensor")
    size = flat.numel()
    for i, (t, offset) in enumerate(zip(many, offsets)):
        check_tensor(op, t, f"{many_name}[{i}]")
        n = t.numel()
        if offset < 0 or offset + n > size:
            raise ValueError(f"{op}: offsets[{i}] + {many_name}[{i}].numel() = {offset} + {n} is outside "
                             f"{flat_name} (numel {size}); the range must lie inside it")


def check_tensor(op: str, t: torch.Tensor, name: str) -> None:
    """The checks every op makes of a tensor argument before the kernel sees it (named TypeError/ValueError)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16 (cast it "
                        f"first)")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous (stride {t.stride()}, shape {tuple(t.shape)}); pass "
                         f".contiguous()")
