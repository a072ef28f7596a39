"""copy_into / copy_out: the compiled op against the pure-torch path, bitwise, over every dtype pair, scale
1 and 1/3, empty lists, zero-size and odd sizes and sizes around the chunk boundary; refusals with named
errors from the Python checks and from the C++ TORCH_CHECKs.

The compiled side is built with ZERO_ENGINE_OPS=require, so a broken build fails these tests instead of
quietly comparing the fallback with itself. Bitwise equality is the contract (see [Note: copy semantics]
in engine/ops/flatten.py); the data holds no NaN because NaN payloads are not part of it.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.ops import builder, flatten
from engine.ops.flatten import copy_into, copy_out, torch_copy_into, torch_copy_out

K = 1 << 14  # zero_engine::kChunk (csrc/cpu/ops.h): chunks of this many elements, never crossing a tensor
SIZES = [0, 1, 3, K - 1, K, K + 1, 2 * K + 5, 1000003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [1.0, 1 / 3]
GAP = 5  # elements left between the ranges: they must come out untouched
SENTINEL = -7.0


def make(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with float32 subnormals and values past float16's range mixed in (no NaN)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    x[1::7] *= 1e-40
    x[2::11] *= 3e4
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], GAP
    for n in sizes:
        offsets.append(end)
        end += n + GAP
    return offsets, end


def sources(dtype: torch.dtype) -> list[torch.Tensor]:
    srcs = [make(n, dtype, seed) for seed, n in enumerate(SIZES)]
    srcs.append(make(12, dtype, 99).view(3, 4))  # any shape, read in row-major order
    return srcs


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_copy_into_matches_torch_bitwise(
    ext: ModuleType, src_dtype: torch.dtype, dst_dtype: torch.dtype, scale: float
) -> None:
    srcs = sources(src_dtype)
    offsets, size = layout([s.numel() for s in srcs])
    got = torch.full((size,), SENTINEL, dtype=dst_dtype)
    want = got.clone()
    copy_into(got, srcs, offsets, scale)
    torch_copy_into(want, srcs, offsets, scale)
    assert torch.equal(bits(got), bits(want))
    assert got[:GAP].eq(SENTINEL).all() and got[-GAP:].eq(SENTINEL).all()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_copy_out_matches_torch_bitwise(
    ext: ModuleType, src_dtype: torch.dtype, dst_dtype: torch.dtype, scale: float
) -> None:
    shapes = [(n,) for n in SIZES] + [(3, 4)]
    offsets, size = layout([torch.Size(s).numel() for s in shapes])
    src = make(size, src_dtype, 7)
    got = [torch.full(s, SENTINEL, dtype=dst_dtype) for s in shapes]
    want = [t.clone() for t in got]
    copy_out(src, got, offsets, scale)
    torch_copy_out(src, want, offsets, scale)
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))


STREAM_BYTES = 16 << 20  # zero_engine::kStreamBytes (csrc/cpu/flatten.cpp): larger outputs use streaming stores


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_large_outputs_take_the_streaming_path_bitwise(
    ext: ModuleType, src_dtype: torch.dtype, dst_dtype: torch.dtype, scale: float
) -> None:
    """Over kStreamBytes of output the copy writes with non-temporal stores from each range's first
    aligned address: odd offsets (unaligned heads), odd sizes (tails) and the gaps must come out exact."""
    sizes = [STREAM_BYTES // 2 // dst_dtype.itemsize + 3, 1, 2 * K + 7, STREAM_BYTES // 2 // dst_dtype.itemsize + 1]
    srcs = [make(n, src_dtype, seed) for seed, n in enumerate(sizes)]
    offsets, size = layout(sizes)
    assert (size - (len(sizes) + 1) * GAP) * dst_dtype.itemsize >= STREAM_BYTES
    got = torch.full((size,), SENTINEL, dtype=dst_dtype)
    want = got.clone()
    copy_into(got, srcs, offsets, scale)
    torch_copy_into(want, srcs, offsets, scale)
    assert torch.equal(bits(got), bits(want))
    flat = make(size, src_dtype, 11)
    outs = [torch.full((n,), SENTINEL, dtype=dst_dtype) for n in sizes]
    wants = [t.clone() for t in outs]
    copy_out(flat, outs, offsets, scale)
    torch_copy_out(flat, wants, offsets, scale)
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(outs, wants))


def test_compiled_op_is_the_one_used_on_cpu(ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def torch_path(*args: object) -> None:
        raise AssertionError("the torch path ran although the extension is loaded")

    monkeypatch.setattr(flatten, "torch_copy_into", torch_path)
    monkeypatch.setattr(flatten, "torch_copy_out", torch_path)
    dst, out = torch.zeros(8), torch.zeros(3)
    copy_into(dst, [torch.ones(3)], [2], 2.0)
    copy_out(dst, [out], [1])
    assert dst.tolist() == [0, 0, 2, 2, 2, 0, 0, 0]
    assert out.tolist() == [0, 2, 2]


def test_empty_lists_and_zero_size_tensors(ext: ModuleType) -> None:
    dst = torch.full((4,), SENTINEL)
    copy_into(dst, [], [])
    copy_out(dst, [], [], 0.5)
    copy_into(dst, [torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16)], [0, 4])  # offset == numel is fine
    copy_into(torch.empty(0), [torch.empty(0)], [0], 1 / 3)
    copy_out(torch.empty(0, dtype=torch.float16), [torch.empty(0)], [0])
    assert dst.eq(SENTINEL).all()


def test_nan_and_inf_propagate(ext: ModuleType) -> None:
    src = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    for dtype in DTYPES:
        got, want = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)
        copy_into(got, [src], [0], 1 / 3)
        torch_copy_into(want, [src], [0], 1 / 3)
        assert got.isnan().tolist() == want.isnan().tolist() == [True, False, False, False]
        assert torch.equal(got[1:], want[1:])


def test_results_do_not_depend_on_the_thread_count(ext: ModuleType) -> None:
    srcs = sources(torch.bfloat16)
    offsets, size = layout([s.numel() for s in srcs])
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(torch.zeros(size))
            copy_into(results[-1], srcs, offsets, 1 / 3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(results[0]), bits(results[1]))


def test_fallback_mode_uses_the_torch_path(ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(builder.ENV_MODE, "fallback")
    builder.reset_for_tests()
    try:
        assert builder.load() is None
        dst = torch.zeros(6, dtype=torch.bfloat16)
        copy_into(dst, [torch.tensor([3.0, 6.0])], [1], 1 / 3)
        assert dst.tolist() == [0, 1, 2, 0, 0, 0]
    finally:
        builder.reset_for_tests()  # the next test loads the compiled module again (ZERO_ENGINE_OPS=require)


# --- refusals: the Python checks (both paths) and the C++ checks (the compiled op called directly) -------


def bad_calls() -> list[tuple[str, str, tuple, str]]:
    """(op, case, args, message pattern)."""
    dst, ok = torch.zeros(10), torch.ones(3)
    strided = torch.ones(4, 6)[:, ::2]
    return [
        (
            "copy_into",
            "non-contiguous source",
            (dst, [ok, strided], [0, 3], 1.0),
            r"srcs\[1\] is not contiguous \(stride .*pass \.contiguous\(\)",
        ),
        (
            "copy_out",
            "non-contiguous destination",
            (dst, [torch.zeros(2, 3).t()], [0], 1.0),
            r"dsts\[0\] is not contiguous \(stride .*pass \.contiguous\(\)",
        ),
        (
            "copy_into",
            "range past the end",
            (dst, [ok, ok], [0, 8], 1.0),
            r"offsets\[1\] \+ srcs\[1\]\.numel\(\) = 8 \+ 3 is outside dst \(numel 10\)",
        ),
        ("copy_out", "negative offset", (dst, [ok], [-1], 1.0), r"offsets\[0\] \+ dsts\[0\]\.numel\(\) = -1 \+ 3"),
        ("copy_into", "offsets length", (dst, [ok, ok], [0], 1.0), r"len\(srcs\) = 2 != len\(offsets\) = 1"),
        (
            "copy_into",
            "unsupported dtype",
            (dst, [ok.double()], [0], 1.0),
            r"srcs\[0\] has dtype .*; supported: float32, bfloat16, float16",
        ),
        ("copy_out", "2-D flat buffer", (dst.view(2, 5), [ok], [0], 1.0), r"src must be 1-D"),
    ]


@pytest.mark.parametrize(("op", "case", "args", "pattern"), bad_calls(), ids=[c[1] for c in bad_calls()])
def test_python_checks_name_the_problem(ext: ModuleType, op: str, case: str, args: tuple, pattern: str) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        getattr(flatten, op)(*args)


@pytest.mark.parametrize(("op", "case", "args", "pattern"), bad_calls(), ids=[c[1] for c in bad_calls()])
def test_cpp_checks_name_the_problem(ext: ModuleType, op: str, case: str, args: tuple, pattern: str) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        getattr(ext, op)(*args)
