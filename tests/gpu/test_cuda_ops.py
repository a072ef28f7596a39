"""The CUDA ops (csrc/cuda/) against torch references, on a GPU: bitwise for copies and casts, a
tolerance for sums and Adam (each explained where it is used).

Not part of the default run (tests/conftest.py leaves tests/gpu out); on a machine with a CUDA GPU, a
CUDA build of torch, nvcc and ninja run `python -m pytest tests/gpu -q`. The first run builds the
extension into the per-user cache (a minute or two). Every test fails, rather than skips, without a GPU.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.ops import builder, cuda_builder

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CHUNK = 1 << 16  # kChunk in csrc/cuda/multi_tensor.cuh: sizes around it cross chunk boundaries
SIZES = [1, 3, 4, 5, 1000, CHUNK - 1, CHUNK + 5, 2 * CHUNK + 3]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def ext():
    assert torch.cuda.is_available(), "tests/gpu needs a CUDA GPU and a CUDA build of torch"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZERO_ENGINE_OPS", "require")  # a failed build is an error here, not a fallback
        cuda_builder.reset_for_tests()
        module = cuda_builder.load()
    assert module is not None, cuda_builder.status().reason
    return module


def cpu_op(name: str):
    """The CPU extension's op of that name when it is built and has it (a second reference), else None."""
    module = builder.load()
    return getattr(module, name, None) if module is not None else None


def values(n: int, seed: int, dtype: torch.dtype = torch.float32, finite: bool = False) -> torch.Tensor:
    """n values on the CPU: normals over many binades, and in front the cases that test rounding:
    signed zeros, float32 subnormals, values exactly halfway between two bfloat16 or float16 numbers
    (round to nearest even goes down for one, up for the other), values that overflow float16 and
    bfloat16, and infinities (unless finite)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-12, 12, (n,), generator=generator).float())
    special = [0.0, -0.0, 1e-40, -3e-39, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 65520.0, 3.3e38]
    if not finite:
        special += [math.inf, -math.inf]
    head = torch.tensor(special[:n], dtype=torch.float32)
    x[: head.numel()] = head
    if finite:
        x = x.clamp(-6e4, 6e4)  # finite in float16 too
    return x.to(dtype)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    view = INT_VIEW[actual.dtype]
    mismatch = (actual.cpu().view(view) != expected.cpu().view(view)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} elements differ, first at {mismatch[0].tolist()}: "
        f"{actual.cpu().flatten()[mismatch[0, 0]]} vs {expected.flatten()[mismatch[0, 0]]}"
    )


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets with gaps of 0, 1 and 2 elements (so some tensors start misaligned) and the total length."""
    offsets, end = [], 0
    for i, n in enumerate(sizes):
        offsets.append(end + i % 3)
        end = offsets[-1] + n
    return offsets, end + 2


# ---------------------------------------------------------------- copy_into / copy_out


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("scale", [1.0, 0.125, 1 / 3])
def test_copy_into_is_bitwise_torch(ext, src_dtype, dst_dtype, scale) -> None:
    srcs = [values(n, seed=i, dtype=src_dtype) for i, n in enumerate(SIZES)]
    srcs[4] = srcs[4].view(10, 100)  # any contiguous shape
    offsets, total = layout(SIZES)
    expected = torch.full((total,), 7.0, dtype=dst_dtype)  # gaps keep their 7
    for src, offset in zip(srcs, offsets):
        expected[offset : offset + src.numel()] = (src.float().flatten() * scale).to(dst_dtype)

    dst = torch.full((total,), 7.0, dtype=dst_dtype, device="cuda")
    ext.copy_into(dst, [s.cuda() for s in srcs], offsets, scale)
    assert_bitwise(dst, expected)
    cpu_copy_into = cpu_op("copy_into")
    if cpu_copy_into is not None:
        on_cpu = torch.full((total,), 7.0, dtype=dst_dtype)
        cpu_copy_into(on_cpu, srcs, offsets, scale)
        assert_bitwise(dst, on_cpu)


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_copy_out_is_bitwise_torch(ext, src_dtype, dst_dtype, scale) -> None:
    offsets, total = layout(SIZES)
    src = values(total, seed=1, dtype=src_dtype)
    dsts = [torch.zeros(n, dtype=dst_dtype) for n in SIZES]
    expected = [(src[o : o + n].float() * scale).to(dst_dtype) for o, n in zip(offsets, SIZES)]

    on_gpu = [d.cuda() for d in dsts]
    ext.copy_out(src.cuda(), on_gpu, offsets, scale)
    for actual, want in zip(on_gpu, expected):
        assert_bitwise(actual, want)
    cpu_copy_out = cpu_op("copy_out")
    if cpu_copy_out is not None:
        cpu_copy_out(src, dsts, offsets, scale)
        for actual, on_cpu in zip(on_gpu, dsts):
            assert_bitwise(actual, on_cpu)


def test_copy_runs_on_the_current_stream(ext) -> None:
    src = torch.arange(4096, dtype=torch.float32, device="cuda")
    dst = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    ext.copy_into(dst, [src], [0], 1.0)  # warm the allocators: no first-time allocation may sync below
    dst.zero_()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy on `side`
        ext.copy_into(dst, [src], [0], 1.0)
    snapshot = dst.clone()  # on the default stream, which does not wait for `side`
    torch.cuda.synchronize()
    assert snapshot.count_nonzero() == 0, "the copy ran on the default stream, not the current one"
    assert_bitwise(dst, src.cpu().to(torch.bfloat16))


def test_copy_checks_its_arguments(ext) -> None:
    dst = torch.zeros(8, device="cuda")
    src = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.copy_into(dst, [src], [5], 1.0)
    with pytest.raises(RuntimeError, match="one offset per tensor"):
        ext.copy_into(dst, [src], [0, 4], 1.0)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        ext.copy_into(dst, [src.cpu()], [0], 1.0)
    with pytest.raises(RuntimeError, match="expected float32, bfloat16 or float16"):
        ext.copy_into(dst, [src.int()], [0], 1.0)
    with pytest.raises(RuntimeError, match="not contiguous"):
        ext.copy_out(dst, [torch.zeros(4, 2, device="cuda").t()], [0], 1.0)
    with pytest.raises(RuntimeError, match="1-D"):
        ext.copy_out(dst.view(2, 4), [src], [0], 1.0)


# ---------------------------------------------------------------- sum_squares_and_overflow


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    return [
        values(n, seed=seed + i, dtype=dtype, finite=True)
        for i, (n, dtype) in enumerate(zip(SIZES, itertools.cycle(DTYPES)))
    ]


@pytest.mark.parametrize("scale", [1.0, 1 / 1024, 0.3])
def test_sum_squares_matches_a_float64_sum(ext, scale) -> None:
    tensors = mixed_tensors(seed=0)
    total, overflow = ext.sum_squares_and_overflow([t.cuda() for t in tensors], scale)
    # Each term is (float(x) * float(scale))^2, the product rounded to float32 as in torch's x.float() * scale.
    expected = sum(((t.float() * scale).double() ** 2).sum().item() for t in tensors)
    assert overflow is False
    # Both sum in float64, in different orders: a few ulps of 1e-16 each over ~2e5 terms.
    assert total == pytest.approx(expected, rel=1e-12)
    cpu_sum = cpu_op("sum_squares_and_overflow")
    if cpu_sum is not None:
        cpu_total, cpu_overflow = cpu_sum(tensors, scale)
        assert cpu_overflow is False and total == pytest.approx(cpu_total, rel=1e-12)


def test_sum_squares_is_deterministic_and_independent_of_alignment(ext) -> None:
    tensors = [t.cuda() for t in mixed_tensors(seed=5)]
    first = ext.sum_squares_and_overflow(tensors, 0.5)
    assert all(ext.sum_squares_and_overflow(tensors, 0.5) == first for _ in range(5))
    # The same values one element further into a buffer take the unaligned path: the same bits.
    shifted = []
    for t in tensors:
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        buffer[1:] = t
        shifted.append(buffer[1:])
    assert ext.sum_squares_and_overflow(shifted, 0.5) == first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, CHUNK + 2, 2 * CHUNK + 2])
def test_overflow_is_found_anywhere(ext, dtype, bad, where) -> None:
    tensors = [values(n, seed=3, dtype=dtype, finite=True).cuda() for n in (10, 2 * CHUNK + 3)]
    assert ext.sum_squares_and_overflow(tensors, 1.0)[1] is False
    tensors[1][where] = bad
    assert ext.sum_squares_and_overflow(tensors, 1.0)[1] is True


def test_sum_squares_of_nothing(ext) -> None:
    assert ext.sum_squares_and_overflow([], 1.0) == (0.0, False)
    assert ext.sum_squares_and_overflow([torch.empty(0, device="cuda")], 1.0) == (0.0, False)


# ---------------------------------------------------------------- adam_step

LR, BETAS, EPS, WEIGHT_DECAY, GRAD_SCALE = 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.5
ADAM_SIZES = [1, 5, 1000, CHUNK + 3]


def reference_adam(params, grads, exp_avgs, exp_avg_sqs, adamw_mode: bool, step: int, bias_correction: bool) -> None:
    """The naive path: torch.optim's single-tensor Adam/AdamW, plus DeepSpeed's bias_correction=False."""
    correction1 = 1 - BETAS[0] ** step if bias_correction else 1.0
    correction2 = 1 - BETAS[1] ** step if bias_correction else 1.0
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g.float() * GRAD_SCALE
        if adamw_mode:
            p.mul_(1 - LR * WEIGHT_DECAY)
        else:
            g = g.add(p, alpha=WEIGHT_DECAY)
        m.lerp_(g, 1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        p.addcdiv_(m, v.sqrt() / math.sqrt(correction2) + EPS, value=-LR / correction1)


# float32 arithmetic done in another order (fused multiply-adds, one kernel instead of several) differs
# by about an ulp per step; over 100 steps that stays well under 1e-5 relative, while a wrong formula
# (a bias correction one step off, decay applied twice) is off by more than 1e-3.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("lp_dtype", [None, torch.bfloat16, torch.float16])
def test_adam_matches_torch_optim_over_100_steps(ext, grad_dtype, adamw_mode, lp_dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=generator) for n in ADAM_SIZES]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    lp_params = [p.to(lp_dtype) for p in params] if lp_dtype is not None else []
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    optimizer = optimizer_class(reference, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    for step in range(1, 101):
        grads = [torch.randn(n, device="cuda", generator=generator).to(grad_dtype) for n in ADAM_SIZES]
        for r, g in zip(reference, grads):
            r.grad = g.float() * GRAD_SCALE
        optimizer.step()
        ext.adam_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            lp_params,
            LR,
            BETAS[0],
            BETAS[1],
            EPS,
            WEIGHT_DECAY,
            adamw_mode,
            step,
            True,
            GRAD_SCALE,
        )
    for p, m, v, r in zip(params, exp_avgs, exp_avg_sqs, reference):
        torch.testing.assert_close(p, r.detach(), **TOLERANCE)
        torch.testing.assert_close(m, optimizer.state[r]["exp_avg"], **TOLERANCE)
        torch.testing.assert_close(v, optimizer.state[r]["exp_avg_sq"], **TOLERANCE)
    for lp, p in zip(lp_params, params):
        assert_bitwise(lp, p.to(lp_dtype))  # written in the same pass from the same float32 value


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_adam_without_bias_correction(ext, adamw_mode) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.randn(n, device="cuda", generator=generator) for n in ADAM_SIZES]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    expected = [p.clone() for p in params]
    expected_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    for step in range(1, 21):
        grads = [torch.randn(n, device="cuda", generator=generator).to(torch.bfloat16) for n in ADAM_SIZES]
        ext.adam_step(
            params,
            grads,
            state[0],
            state[1],
            [],
            LR,
            BETAS[0],
            BETAS[1],
            EPS,
            WEIGHT_DECAY,
            adamw_mode,
            step,
            False,
            GRAD_SCALE,
        )
        reference_adam(expected, grads, expected_state[0], expected_state[1], adamw_mode, step, False)
    for actual, want in zip(params + state[0] + state[1], expected + expected_state[0] + expected_state[1]):
        torch.testing.assert_close(actual, want, **TOLERANCE)


def test_adam_matches_the_cpu_extension(ext) -> None:
    cpu_adam = cpu_op("adam_step")
    generator = torch.Generator().manual_seed(2)
    params = [torch.randn(n, generator=generator) for n in ADAM_SIZES]
    cpu_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    gpu_params = [p.cuda() for p in params]
    gpu_state = [[torch.zeros_like(p) for p in gpu_params] for _ in range(2)]
    for step in range(1, 11):
        grads = [torch.randn(n, generator=generator).to(torch.float16) for n in ADAM_SIZES]
        ext.adam_step(
            gpu_params,
            [g.cuda() for g in grads],
            gpu_state[0],
            gpu_state[1],
            [],
            LR,
            BETAS[0],
            BETAS[1],
            EPS,
            WEIGHT_DECAY,
            True,
            step,
            True,
            GRAD_SCALE,
        )
        if cpu_adam is not None:
            cpu_adam(
                params,
                grads,
                cpu_state[0],
                cpu_state[1],
                [],
                LR,
                BETAS[0],
                BETAS[1],
                EPS,
                WEIGHT_DECAY,
                True,
                step,
                True,
                GRAD_SCALE,
            )
        else:  # no CPU extension op (yet): the naive path stands in for it
            reference_adam(params, grads, cpu_state[0], cpu_state[1], True, step, True)
    for actual, want in zip(gpu_params + gpu_state[0] + gpu_state[1], params + cpu_state[0] + cpu_state[1]):
        torch.testing.assert_close(actual.cpu(), want, **TOLERANCE)


def test_adam_checks_its_arguments(ext) -> None:
    p = torch.zeros(8, device="cuda")
    m, v, g = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    with pytest.raises(RuntimeError, match="one of each per param"):
        ext.adam_step([p], [g, g], [m], [v], [], *args, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="expected >= 1"):
        ext.adam_step([p], [g], [m], [v], [], *args, 0, True, 1.0)
    with pytest.raises(RuntimeError, match="expected bfloat16 or float16"):
        ext.adam_step([p], [g], [m], [v], [p.clone()], *args, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="expected float32"):
        ext.adam_step([p.half()], [g], [m], [v], [], *args, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="elements but params"):
        ext.adam_step([p], [g[:4]], [m], [v], [], *args, 1, True, 1.0)


# ---------------------------------------------------------------- the engine's ops dispatch here
def test_engine_ops_send_cuda_tensors_to_the_cuda_module(ext, monkeypatch) -> None:
    """engine/ops/select.py: copy_into, sum_squares_and_overflow and adam_step on CUDA tensors run the
    CUDA module, never the torch fallback (made to fail here)."""
    from engine.ops import adam, flatten, overflow

    def no_fallback(*_args, **_kwargs):
        raise AssertionError("the torch fallback ran for CUDA tensors")

    monkeypatch.setattr(flatten, "torch_copy_into", no_fallback)
    monkeypatch.setattr(overflow, "torch_sum_squares_and_overflow", no_fallback)
    monkeypatch.setattr(adam, "adam_step_reference", no_fallback)
    src = values(1000, 1, finite=True).cuda()  # finite: the overflow flag must come back False
    dst = torch.zeros(1000, device="cuda")
    flatten.copy_into(dst, [src], [0], 0.5)
    assert torch.equal(dst, src * 0.5)
    total, overflowed = overflow.sum_squares_and_overflow([src])
    assert not overflowed and math.isclose(total, float((src.double() ** 2).sum()), rel_tol=1e-9)
    p, g = src.clone(), values(1000, 2).cuda()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    adam.adam_step(
        adam.AdamTensors([p], [g], [m], [v]),
        adam.AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1),
    )
    assert not torch.equal(p, src)
