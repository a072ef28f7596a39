"""sum_squares_and_overflow: the compiled op against the pure-torch path over every dtype, odd sizes and
sizes around the chunk boundary, scale 1 and 1/3; inf/nan found wherever they sit; results bitwise the
same at 1 and 2 threads; refusals with named errors.

Tolerance: both paths add the same exactly-squared float64 terms (all >= 0) in different orders, so they
differ by float64 rounding only: at most ~n * 2^-53 relative for n terms, 1.2e-10 for the ~1.1M here.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from engine.ops import overflow as overflow_ops
from engine.ops.overflow import (
    KnownSquares,
    add_in_order,
    chunk_sum_squares,
    sum_squares_and_overflow,
    sum_squares_of,
    torch_sum_squares_and_overflow,
)

K = 1 << 14  # zero_engine::kChunk (csrc/cpu/ops.h)
SIZES = [0, 1, 3, K - 1, K, K + 1, 2 * K + 5, 1000003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REL = 2e-10  # see the module docstring
INF, NAN = float("inf"), float("nan")


def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(n, generator=g) * 10).to(dtype) for n in SIZES]
    out.append(torch.randn(3, 4, generator=g).to(dtype))
    return out


@pytest.mark.parametrize("scale", [1.0, 1 / 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch(ext: ModuleType, dtype: torch.dtype, scale: float) -> None:
    ts = tensors(dtype)
    got, got_overflow = sum_squares_and_overflow(ts, scale)
    want, want_overflow = torch_sum_squares_and_overflow(ts, scale)
    assert got == pytest.approx(want, rel=REL) and got > 0
    assert got_overflow is want_overflow is False


def test_exact_on_a_small_case(ext: ModuleType) -> None:
    # float32(3 * 0.5) = 1.5, float32(-4 * 0.5) = -2: 2.25 + 4 = 6.25, exact in float64
    assert sum_squares_and_overflow([torch.tensor([3.0]), torch.tensor([[-4.0]], dtype=torch.bfloat16)], 0.5) == (
        6.25,
        False,
    )


def test_mixed_dtypes_add_up(ext: ModuleType) -> None:
    parts = [tensors(dtype) for dtype in DTYPES]
    got, _ = sum_squares_and_overflow([t for ts in parts for t in ts], 1 / 3)
    want = math.fsum(torch_sum_squares_and_overflow(ts, 1 / 3)[0] for ts in parts)
    assert got == pytest.approx(want, rel=REL)


def test_empty_list_and_zero_size_tensors(ext: ModuleType) -> None:
    assert sum_squares_and_overflow([]) == (0.0, False)
    assert sum_squares_and_overflow([torch.empty(0), torch.empty(0, 5, dtype=torch.float16)], 2.0) == (0.0, False)
    assert torch_sum_squares_and_overflow([torch.empty(0)]) == (0.0, False)


# (tensor, element) positions in tensors(): 8 is the 3x4 one (the last), 7 the 1000003-element one, 5 has K + 1
@pytest.mark.parametrize(
    ("dtype", "tensor", "element", "value"),
    [
        (torch.float32, 8, 11, INF),
        (torch.float16, 7, 1000002, -INF),
        (torch.bfloat16, 7, 123457, NAN),
        (torch.bfloat16, 1, 0, INF),
        (torch.float16, 5, K, NAN),
    ],
    ids=["fp32-inf-very-last", "fp16-neg-inf-end-of-big", "bf16-nan-middle", "bf16-inf-first", "fp16-nan-2nd-chunk"],
)
def test_inf_and_nan_are_found(ext: ModuleType, dtype: torch.dtype, tensor: int, element: int, value: float) -> None:
    ts = tensors(dtype)
    ts[tensor].view(-1)[element] = value
    for fn in (sum_squares_and_overflow, torch_sum_squares_and_overflow):
        total, overflow = fn(ts, 1 / 3)
        assert overflow is True and not math.isfinite(total), fn.__name__


def test_inf_is_found_with_scale_zero(ext: ModuleType) -> None:
    for fn in (sum_squares_and_overflow, torch_sum_squares_and_overflow):
        assert fn([torch.tensor([1.0, INF])], 0.0)[1] is True, fn.__name__


def test_finite_values_overflowing_when_scaled_are_not_flagged(ext: ModuleType) -> None:
    # 3e38 * 4 is past float32's range: the sum is inf, but no element is inf/nan
    for fn in (sum_squares_and_overflow, torch_sum_squares_and_overflow):
        assert fn([torch.tensor([1.0, 3e38])], 4.0) == (INF, False), fn.__name__


def test_bitwise_the_same_at_one_and_two_threads(ext: ModuleType) -> None:
    ts = tensors(torch.bfloat16) + tensors(torch.float32)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            results.append(sum_squares_and_overflow(ts, 1 / 3))
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1] == results[2]
    assert math.isfinite(results[0][0]) and results[0][1] is False


def test_compiled_op_is_the_one_used_on_cpu(ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def torch_path(*args: object) -> tuple[float, bool]:
        raise AssertionError("the torch path ran although the extension is loaded")

    monkeypatch.setattr(overflow_ops, "torch_sum_squares_and_overflow", torch_path)
    assert sum_squares_and_overflow([torch.tensor([2.0, -1.0])]) == (5.0, False)


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        (torch.ones(4, 6)[:, ::2], r"tensors\[1\] is not contiguous \(stride .*pass \.contiguous\(\)"),
        (torch.ones(3, dtype=torch.float64), r"tensors\[1\] has dtype .*; supported: float32, bfloat16, float16"),
    ],
    ids=["non-contiguous", "float64"],
)
def test_refusals_name_the_tensor(ext: ModuleType, bad: torch.Tensor, pattern: str) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        sum_squares_and_overflow([torch.ones(2), bad])
    with pytest.raises(RuntimeError, match=pattern):  # the C++ check, for callers of the op itself
        ext.sum_squares_and_overflow([torch.ones(2), bad], 1.0)


# --- the partial sums taken early (chunk_sum_squares, KnownSquares, sum_squares_of) ---------------------


def _split_known(ts: list[torch.Tensor], known: set[int]) -> list[torch.Tensor | KnownSquares]:
    """`ts` with the tensors at `known` replaced by their partial sums, each taken on its own."""
    return [KnownSquares(*chunk_sum_squares([t])) if i in known else t for i, t in enumerate(ts)]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("known", [set(), {0}, {3, 4}, set(range(19))], ids=["none", "first", "middle", "all"])
def test_partial_sums_taken_early_add_up_to_the_same_total_bitwise(
    ext: ModuleType, monkeypatch: pytest.MonkeyPatch, compiled: bool, known: set[int]
) -> None:
    """Whatever tensors' partials were taken earlier, and one tensor at a time, the total is the one
    sum_squares_and_overflow gives the whole list: the same float64, not merely close."""
    if not compiled:
        monkeypatch.setattr(overflow_ops, "compiled_module", lambda tensors: None)
    ts = tensors(torch.bfloat16) + tensors(torch.float32)
    want = sum_squares_and_overflow(ts)
    got = sum_squares_of(_split_known(ts, known))
    assert got == want and got[0] > 0, (got, want)
    partials, overflow = chunk_sum_squares(ts)
    # One partial per chunk of K (compiled) or _PIECE (torch) elements; torch's split gives an empty
    # tensor one empty piece, whose 0.0 adds nothing.
    pieces = (
        [-(-t.numel() // K) for t in ts] if compiled else [max(1, -(-t.numel() // overflow_ops._PIECE)) for t in ts]
    )
    assert len(partials) == sum(pieces) and not overflow
    assert add_in_order(partials) == want[0]


def test_partial_sums_carry_inf_and_nan(ext: ModuleType) -> None:
    ts = [torch.ones(K + 3), torch.tensor([1.0, INF]), torch.ones(5)]
    total, overflow = sum_squares_of(_split_known(ts, {1}))
    assert overflow and math.isinf(total)
    total, overflow = sum_squares_of(_split_known([torch.ones(3), torch.tensor([NAN])], {0}))
    assert overflow and math.isnan(total)


def test_partial_sums_refuse_what_the_norm_refuses(ext: ModuleType) -> None:
    with pytest.raises((ValueError, TypeError), match=r"tensors\[1\] is not contiguous"):
        chunk_sum_squares([torch.ones(2), torch.ones(4, 6)[:, ::2]])
    meta = torch.ones(3, device="meta")
    with pytest.raises((ValueError, TypeError), match="CPU tensors only|device"):
        chunk_sum_squares([meta])
