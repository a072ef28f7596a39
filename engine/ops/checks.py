"""The argument checks of the CPU/CUDA ops (engine/ops/flatten, overflow, accumulate, adam), shared by their
torch fallbacks and the compiled library's binding (engine/ops/cpu_lib.py), which names a bad argument with
the same message. Below both in the import order, so the ops and the binding each import it and not each
other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# --- flatten: copy_into / copy_out ----------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_copy_args(
    op: str, flat: torch.Tensor, flat_name: str, many: Sequence[torch.Tensor], many_name: str, offsets: Sequence[int]
) -> None:
    """copy_into's / copy_out's checks of every tensor and range (named TypeError/ValueError), also the
    compiled binding's (engine/ops/cpu_lib.py)."""
    check_tensor(op, flat, flat_name)
    if flat.dim() != 1:
        raise ValueError(
            f"{op}: {flat_name} must be 1-D, got shape {tuple(flat.shape)}; pass a flat buffer "
            f"(.view(-1) of a contiguous tensor)"
        )
    if len(many) != len(offsets):
        raise ValueError(
            f"{op}: len({many_name}) = {len(many)} != len(offsets) = {len(offsets)}; give one offset per tensor"
        )
    size = flat.numel()
    for i, (t, offset) in enumerate(zip(many, offsets)):
        check_tensor(op, t, f"{many_name}[{i}]")
        n = t.numel()
        if offset < 0 or offset + n > size:
            raise ValueError(
                f"{op}: offsets[{i}] + {many_name}[{i}].numel() = {offset} + {n} is outside "
                f"{flat_name} (numel {size}); the range must lie inside it"
            )


def check_tensor(op: str, t: torch.Tensor, name: str) -> None:
    """The checks every op makes of a tensor argument before the kernel sees it (named TypeError/ValueError)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16 (cast it first)")
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} is not contiguous (stride {t.stride()}, shape {tuple(t.shape)}); pass .contiguous()"
        )


# --- overflow: sum_squares_and_overflow -----------------------------------------------------------------


def check_overflow_args(tensors: Sequence[torch.Tensor]) -> None:
    """Every tensor's dtype and contiguity (named TypeError/ValueError), also the compiled binding's
    (engine/ops/cpu_lib.py)."""
    for i, t in enumerate(tensors):
        check_tensor("sum_squares_and_overflow", t, f"tensors[{i}]")


# --- accumulate ------------------------------------------------------------------------------------------

SUPPORTED_PAIRS = frozenset(
    {
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    }
)
"""(dst dtype, src dtype) pairs accumulate takes."""


def check_accumulate_args(dst: torch.Tensor, src: torch.Tensor) -> None:
    """accumulate's checks (named TypeError/ValueError), also the compiled binding's (engine/ops/cpu_lib.py)."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"accumulate: {name} is a {type(t).__name__}, not a torch.Tensor")
    if (dst.dtype, src.dtype) not in SUPPORTED_PAIRS:
        raise TypeError(
            f"accumulate: dst {_dtype_name(dst.dtype)} with src {_dtype_name(src.dtype)} is not supported; "
            "supported: dst float32 with src float32, bfloat16 or float16, or dst bfloat16 / float16 "
            "with src of the same dtype"
        )
    if dst.device != src.device:
        raise ValueError(f"accumulate: dst is on {dst.device} but src is on {src.device}; move them to one device")
    for name, t in (("dst", dst), ("src", src)):
        if not t.is_contiguous():
            raise ValueError(
                f"accumulate: {name} is not contiguous (stride {t.stride()}, shape "
                f"{tuple(t.shape)}); pass .contiguous()"
            )
        if t.dim() != 1:
            raise ValueError(
                f"accumulate: {name} must be 1-D, got shape {tuple(t.shape)}; pass .view(-1) of a contiguous tensor"
            )
    n = dst.numel()
    if src.numel() != n:
        raise ValueError(
            f"accumulate: dst.numel() = {n} != src.numel() = {src.numel()}; dst and src must have "
            "the same number of elements"
        )
    d, s = dst.data_ptr(), src.data_ptr()
    disjoint = d + n * dst.element_size() <= s or s + n * src.element_size() <= d
    if n and not disjoint and not (d == s and dst.dtype == src.dtype):
        raise ValueError("accumulate: dst and src partially overlap in memory; pass disjoint tensors (or the same one)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- adam_step -------------------------------------------------------------------------------------------

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_LP_DTYPES = (torch.bfloat16, torch.float16)


class AdamTensors(NamedTuple):
    """The tensor lists of one adam_step, one entry per parameter in each list."""

    params: Sequence[torch.Tensor]
    """float32 masters, updated in place."""
    grads: Sequence[torch.Tensor]
    """float32, bfloat16 or float16; read only."""
    exp_avgs: Sequence[torch.Tensor]
    """float32 first moments."""
    exp_avg_sqs: Sequence[torch.Tensor]
    """float32 second moments."""
    lp_params: Sequence[torch.Tensor] | None = None
    """None/empty, or one bfloat16/float16 tensor per param that receives the updated parameter."""


def check_lists(t: AdamTensors) -> None:
    """One grad, exp_avg, exp_avg_sq (and lp_param, if any) per param, all tensors (named errors)."""
    n = len(t.params)
    if not len(t.grads) == len(t.exp_avgs) == len(t.exp_avg_sqs) == n:
        raise ValueError(
            f"adam_step: one grad, exp_avg and exp_avg_sq per param expected; got {n} params, "
            f"{len(t.grads)} grads, {len(t.exp_avgs)} exp_avgs, {len(t.exp_avg_sqs)} exp_avg_sqs"
        )
    if t.lp_params and len(t.lp_params) != n:
        raise ValueError(
            f"adam_step: lp_params must be empty or hold one tensor per param; got {len(t.lp_params)} for {n} params"
        )
    for name, tensors in zip(t._fields, t):
        for i, x in enumerate(tensors or ()):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"adam_step: {name}[{i}] is {type(x).__name__}, not a tensor")


def check_tensors(t: AdamTensors) -> None:
    """Each tensor's dtype, contiguity, size and device against its param's (any device, one device per
    param): the fallback's checks, and the named errors of the compiled binding (engine/ops/cpu_lib.py)."""
    for i, param in enumerate(t.params):
        lists = [
            ("params", param, (torch.float32,)),
            ("grads", t.grads[i], _GRAD_DTYPES),
            ("exp_avgs", t.exp_avgs[i], (torch.float32,)),
            ("exp_avg_sqs", t.exp_avg_sqs[i], (torch.float32,)),
        ]
        if t.lp_params:
            lists.append(("lp_params", t.lp_params[i], _LP_DTYPES))
        for name, x, dtypes in lists:
            if x.dtype not in dtypes:
                raise TypeError(f"adam_step: {name}[{i}] has dtype {x.dtype}; expected {_dtype_names(dtypes)}")
            if not x.is_contiguous():
                raise ValueError(f"adam_step: {name}[{i}] is not contiguous; pass .contiguous()")
            if x.numel() != param.numel():
                raise ValueError(f"adam_step: {name}[{i}] has {x.numel()} elements but params[{i}] has {param.numel()}")
            if x.device != param.device:
                raise ValueError(
                    f"adam_step: {name}[{i}] is on {x.device} but params[{i}] is on {param.device}; "
                    "keep each param's tensors on one device"
                )


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
