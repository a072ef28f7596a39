"""engine.comm's reduce-scatter and all-gather (pairwise point-to-point on gloo) against the
arithmetic they must perform and against torch's native collectives, on real processes."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from engine import comm

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _rank_data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _exercise(slice_numel: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    rank, n = comm.get_rank(), comm.get_world_size()
    numel = slice_numel * n
    out: dict[str, torch.Tensor] = {}
    # Out of place, several in flight at once (as buckets are), waited for in reverse order.
    inputs = [_rank_data(rank, numel, dtype) + i for i in range(3)]
    outputs = [torch.empty(slice_numel, dtype=dtype) for _ in range(3)]
    works = [comm.reduce_scatter(o, x, async_op=True) for o, x in zip(outputs, inputs)]
    for w in reversed(works):
        w.wait()
    for i, o in enumerate(outputs):
        out[f"rs{i}"] = o.clone()
    # In place: the output is this rank's slice of the input.
    buf = _rank_data(rank, numel, dtype)
    comm.reduce_scatter(buf[rank * slice_numel:(rank + 1) * slice_numel], buf)
    out["rs_inplace"] = buf[rank * slice_numel:(rank + 1) * slice_numel].clone()
    # All-gather in place and out of place.
    full = torch.zeros(numel, dtype=dtype)
    full[rank * slice_numel:(rank + 1) * slice_numel] = _rank_data(rank, slice_numel, dtype)
    comm.all_gather(full, full[rank * slice_numel:(rank + 1) * slice_numel], async_op=True).wait()
    out["ag_inplace"] = full.clone()
    other = torch.full((numel,), -1.0, dtype=dtype)
    comm.all_gather(other, _rank_data(rank, slice_numel, dtype))
    out["ag"] = other
    return out


def _exercise_all_dtypes(slice_numel: int) -> list[dict[str, torch.Tensor]]:
    return [_exercise(slice_numel, dtype) for dtype in DTYPES]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("slice_numel", [1, 7, 4096])
def test_pairwise_collectives_compute_the_sum_and_the_concatenation(world_size: int, slice_numel: int) -> None:
    per_rank = run_distributed(_exercise_all_dtypes, world_size, args=(slice_numel,))
    for d, dtype in enumerate(DTYPES):
        numel = slice_numel * world_size
        for rank, result in enumerate(r[d] for r in per_rank):
            mine = slice(rank * slice_numel, (rank + 1) * slice_numel)
            for i in range(3):
                want = sum((_rank_data(r, numel, dtype) + i).double() for r in range(world_size))[mine]
                torch.testing.assert_close(result[f"rs{i}"].double(), want, atol=_tol(dtype), rtol=0)
            want = sum(_rank_data(r, numel, dtype).double() for r in range(world_size))[mine]
            torch.testing.assert_close(result["rs_inplace"].double(), want, atol=_tol(dtype), rtol=0)
            gathered = torch.cat([_rank_data(r, slice_numel, dtype) for r in range(world_size)])
            assert torch.equal(result["ag_inplace"], gathered)
            assert torch.equal(result["ag"], gathered)


def _tol(dtype: torch.dtype) -> float:
    # Sums of a few N(0,1) values, rounded to the dtype: bf16 keeps 8 mantissa bits, fp32 24.
    return {torch.bfloat16: 0.1, torch.float32: 1e-5}.get(dtype, 1e-12)


def test_native_switch_gives_the_same_results() -> None:
    pairwise = run_distributed(_exercise, 3, args=(33, torch.float64))
    native = run_distributed(_exercise, 3, args=(33, torch.float64), env={"ZERO_ENGINE_NATIVE_COLLECTIVES": "1"})
    for a, b in zip(pairwise, native):
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-12, rtol=0, msg=key)
