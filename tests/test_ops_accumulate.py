"""accumulate (dst += float32(src) * scale): the compiled op against the pure-torch path, bitwise, for every
supported dtype pair, scales 1, 1/4 and 1/3, sizes 0 to past the threaded path's threshold, at unaligned
offsets; both against a float64 reference within the dtype's rounding; refusals with named errors from
the Python checks and from the C++ TORCH_CHECKs; the builder and the CUDA compile check pick the op up.

The compiled side is built with ZERO_ENGINE_OPS=require (the `ext` fixture, tests/conftest.py), so a
broken build fails these tests instead of quietly comparing the fallback with itself. Bitwise equality is
the contract (see [Note: accumulate semantics] in engine/ops/accumulate.py); the data holds no NaN
because NaN payloads are not part of it. Scale 1/3 is there because 1/4 is a power of two: its product
is exact, so only an inexact scale shows a fused multiply-add (one rounding where the note has two).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.ops import accumulate as accumulate_module
from engine.ops import builder, cuda_builder
from engine.ops.accumulate import accumulate, torch_accumulate
from engine.ops.checks import SUPPORTED_PAIRS

K = 1 << 14  # zero_engine::kChunk (csrc/cpu/ops.h): the threaded path's work unit
PARALLEL = 1 << 19  # kParallelElements (csrc/cpu/accumulate.cpp): from this many elements on, threads split
LARGE = PARALLEL + 3 * K + 7  # threaded, more chunks than threads, a partial last chunk
SIZES = [0, 1, 17, 1000, LARGE]
PAIRS = sorted(SUPPORTED_PAIRS, key=str)  # (dst dtype, src dtype)
SCALES = [1.0, 0.25, 1 / 3]
OFFSETS = [(0, 0), (1, 3), (3, 1)]  # (dst, src) element offsets of the views into bigger buffers
GUARD = 4  # elements of the bigger buffers after the views: they must come out untouched
SENTINEL = -7.0
# The smallest positive subnormal of each dtype: the absolute rounding error near zero.
TINY = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}


def make(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over many binades with float32 subnormals mixed in, finite in `dtype`, and small
    enough that dst + src cannot overflow float16 (no inf, so no NaN from inf - inf)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-10, 10, (n,), generator=g).float())
    x[1::7] *= 1e-40
    return x.clamp(-3e4, 3e4).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def operands(
    n: int, dst_dtype: torch.dtype, src_dtype: torch.dtype, offsets: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dst buffer, dst view, src view): the views start `offsets` elements into bigger buffers whose
    other elements are SENTINEL."""
    dst_off, src_off = offsets
    dst_buf = torch.full((dst_off + n + GUARD,), SENTINEL, dtype=dst_dtype)
    dst_buf[dst_off : dst_off + n] = make(n, dst_dtype, seed)
    src_buf = torch.full((src_off + n + GUARD,), SENTINEL, dtype=src_dtype)
    src_buf[src_off : src_off + n] = make(n, src_dtype, seed + 1000)
    return dst_buf, dst_buf[dst_off : dst_off + n], src_buf[src_off : src_off + n]


@pytest.mark.parametrize("offsets", OFFSETS, ids=[f"offsets{o}" for o in OFFSETS])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES, ids=["1", "1/4", "1/3"])
@pytest.mark.parametrize(("dst_dtype", "src_dtype"), PAIRS, ids=[f"{d}+={s}".replace("torch.", "") for d, s in PAIRS])
def test_compiled_matches_torch_bitwise_and_float64(
    ext: ModuleType, dst_dtype: torch.dtype, src_dtype: torch.dtype, scale: float, n: int, offsets: tuple[int, int]
) -> None:
    dst_buf, dst, src = operands(n, dst_dtype, src_dtype, offsets, seed=n)
    want_buf = dst_buf.clone()
    want = want_buf[offsets[0] : offsets[0] + n]
    before = dst.double()
    accumulate(dst, src, scale)
    torch_accumulate(want, src, scale)
    assert torch.equal(bits(dst_buf), bits(want_buf)), "the compiled op and the torch path differ"
    assert dst_buf[: offsets[0]].eq(SENTINEL).all() and dst_buf[offsets[0] + n :].eq(SENTINEL).all()
    # Against exact float64 math: the float32 product and sum round to within float32's unit roundoff
    # of their operands, the cast into a low-precision dst to within that dtype's.
    product = src.double() * scale
    exact = before + product
    unit = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dst_dtype]
    bound = unit * exact.abs() + 2.0**-23 * (product.abs() + exact.abs()) + TINY[dst_dtype]
    error = (dst.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error over bound {(error / bound).max().item():.3g}"


def test_results_do_not_depend_on_the_thread_count(ext: ModuleType) -> None:
    src = make(LARGE, torch.bfloat16, 1)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(make(LARGE, torch.float32, 2))
            accumulate(results[-1], src, 1 / 3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(results[0]), bits(results[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_dst_may_be_src_itself(ext: ModuleType, dtype: torch.dtype, scale: float) -> None:
    got = make(LARGE, dtype, 3)
    want = got.clone()
    accumulate(got, got, scale)
    torch_accumulate(want, want, scale)
    assert torch.equal(bits(got), bits(want))


def test_low_precision_sums_round_to_nearest_even(ext: ModuleType) -> None:
    """1 + 2^-8 lies halfway between the bfloat16 numbers 1 and 1 + 2^-7: the tie goes to the even one
    (1); 1 + 3 * 2^-8, halfway between 1 + 2^-7 and 1 + 2^-6, goes up to the even 1 + 2^-6."""
    for op in (accumulate, torch_accumulate):
        dst = torch.ones(2, dtype=torch.bfloat16)
        op(dst, torch.tensor([2.0**-8, 3 * 2.0**-8], dtype=torch.bfloat16))
        assert dst.tolist() == [1.0, 1.0 + 2.0**-6], op.__name__


def test_nan_and_inf_propagate(ext: ModuleType) -> None:
    src = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 3e38])
    got, want = torch.full((5,), 3e38), torch.full((5,), 3e38)
    accumulate(got, src, 1 / 3)
    torch_accumulate(want, src, 1 / 3)
    assert got.isnan().tolist() == want.isnan().tolist() == [True, False, False, False, False]
    assert torch.equal(got[1:], want[1:])
    for dtype in (torch.bfloat16, torch.float16):
        big = 6e4 if dtype == torch.float16 else 3e38
        got, want = torch.full((3,), big, dtype=dtype), torch.full((3,), big, dtype=dtype)
        src = torch.tensor([big, -big, float("inf")], dtype=dtype)
        accumulate(got, src)
        torch_accumulate(want, src)
        assert torch.equal(got, want) and got.isinf().tolist() == [True, False, True]


def test_compiled_op_is_the_one_used_on_cpu(ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def torch_path(*args: object) -> None:
        raise AssertionError("the torch path ran although the extension is loaded")

    monkeypatch.setattr(accumulate_module, "torch_accumulate", torch_path)
    dst = torch.ones(4)
    accumulate(dst, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16), 0.5)
    assert dst.tolist() == [1.5, 2.0, 2.5, 3.0]


def test_the_cpu_extension_builds_here_with_accumulate(ext: ModuleType) -> None:
    """Fails (rather than skips) where the CPU extension does not build: the fixture requires it."""
    assert builder.status().state in ("compiled", "cached"), builder.status().reason
    assert callable(getattr(ext, "accumulate", None)), "the extension was built without accumulate.cpp"


def test_builder_compiles_accumulate_and_its_cache_key_follows_the_source_list() -> None:
    source = builder.CSRC / "cpu" / "accumulate.cpp"
    files = builder.sources()
    assert source in files
    compiler = builder.compiler_version()
    without = [f for f in files if f != source]
    assert builder.cache_key(files, compiler) != builder.cache_key(without, compiler), (
        "a changed source list must change the cache key (and so rebuild)"
    )


def test_cuda_compile_check_covers_accumulate() -> None:
    """tests/test_cuda_sources.py compiles ops.cu (every .cuh it includes) and bindings.cpp."""
    cuda = cuda_builder.CUDA_DIR
    assert '#include "accumulate.cuh"' in (cuda / "ops.cu").read_text()
    assert 'm.def("accumulate", &gpu::accumulate' in (cuda / "bindings.cpp").read_text()


def test_fallback_mode_uses_the_torch_path(ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(builder.ENV_MODE, "fallback")
    builder.reset_for_tests()
    try:
        assert builder.load() is None
        dst = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
        accumulate(dst, torch.tensor([3.0, 6.0, 9.0], dtype=torch.bfloat16), 1 / 3)
        assert dst.tolist() == [2.0, 4.0, 6.0]
    finally:
        builder.reset_for_tests()  # the next test loads the compiled module again (ZERO_ENGINE_OPS=require)


# --- refusals: the Python checks (both paths) and the C++ checks (the compiled op called directly) -------


def bad_calls() -> list[tuple[str, tuple, str]]:
    """(case, args, message pattern), each with exactly one problem."""
    buf = torch.zeros(10)
    return [
        (
            "bf16 dst, fp32 src",
            (torch.zeros(4, dtype=torch.bfloat16), torch.ones(4), 1.0),
            r"dst bfloat16 with src float32 is not supported; supported: dst float32 with src float32, bfloat16",
        ),
        (
            "fp16 dst, bf16 src",
            (torch.zeros(4, dtype=torch.float16), torch.ones(4, dtype=torch.bfloat16), 1.0),
            r"dst float16 with src bfloat16 is not supported",
        ),
        (
            "fp64 src",
            (torch.zeros(4), torch.ones(4, dtype=torch.float64), 1.0),
            r"dst float32 with src float64 is not supported",
        ),
        (
            "numel mismatch",
            (torch.zeros(10), torch.ones(9, dtype=torch.bfloat16), 1.0),
            r"dst\.numel\(\) = 10 != src\.numel\(\) = 9",
        ),
        (
            "non-contiguous src",
            (torch.zeros(5), torch.ones(10)[::2], 1.0),
            r"src is not contiguous \(stride .*pass \.contiguous\(\)",
        ),
        ("non-contiguous dst", (torch.zeros(10)[1::2], torch.ones(5), 1.0), r"dst is not contiguous"),
        ("2-D dst", (torch.zeros(2, 3), torch.ones(6), 1.0), r"dst must be 1-D, got shape"),
        ("partial overlap", (buf[0:6], buf[2:8], 1.0), r"dst and src partially overlap in memory"),
        (
            "bf16 view of the fp32 dst",
            (buf[0:4], buf.view(torch.bfloat16)[0:4], 1.0),
            r"dst and src partially overlap in memory",
        ),
    ]


@pytest.mark.parametrize(("case", "args", "pattern"), bad_calls(), ids=[c[0] for c in bad_calls()])
def test_python_checks_name_the_problem(case: str, args: tuple, pattern: str) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        accumulate(*args)


@pytest.mark.parametrize(("case", "args", "pattern"), bad_calls(), ids=[c[0] for c in bad_calls()])
def test_cpp_checks_name_the_problem(ext: ModuleType, case: str, args: tuple, pattern: str) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        ext.accumulate(*args)


def test_python_check_kinds() -> None:
    """dtype problems are TypeErrors, everything else ValueErrors; devices and non-tensors by name."""
    with pytest.raises(TypeError, match="not supported"):
        accumulate(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(TypeError, match=r"accumulate: src is a list, not a torch\.Tensor"):
        accumulate(torch.zeros(2), [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"accumulate: dst is on cpu but src is on meta; move them to one device"):
        accumulate(torch.zeros(2), torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="numel"):
        accumulate(torch.zeros(2), torch.zeros(3))


def test_cpp_check_names_a_tensor_off_the_cpu(ext: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"src is on meta; the compiled op takes CPU tensors"):
        ext.accumulate(torch.zeros(2), torch.zeros(2, device="meta"), 1.0)


def test_zero_size_and_scale_default(ext: ModuleType) -> None:
    accumulate(torch.empty(0), torch.empty(0, dtype=torch.bfloat16))
    accumulate(torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float16), 1 / 3)
    dst = torch.ones(3, dtype=torch.float16)
    accumulate(dst, torch.ones(3, dtype=torch.float16))
    assert dst.tolist() == [2.0, 2.0, 2.0]
