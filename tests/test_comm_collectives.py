"""engine.comm's reduce-scatter and all-gather (point-to-point on gloo, engine/comm/p2p.py) against the
arithmetic they must perform and against torch's native collectives, on real processes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import run_distributed

from engine import comm
from engine.zero.flat import bucket_sizes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Slice sizes: empty, one element, odd, and one received in several segments per peer (with 4 KiB
# segments, set for these tests so that small buffers take the pipelined path; the default 4 MiB
# segments run in test_default_segments_on_megabytes).
SLICES = [0, 1, 7, 70_001]
SMALL_SEGMENTS = {"ZERO_ENGINE_SEGMENT_BYTES": "4096"}
IMPLS = ("p2p", "ring", "native")  # direct exchanges, rings, torch's


def _rank_data(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel + salt)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _ordered_sum(
    parts: list[torch.Tensor],
    rank: int,
    dtype: torch.dtype,
    impl: str = "p2p",
    partial_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The sum the engine's reduce-scatter computes on `rank`, each addition in float32 math rounded
    once (float64 stays float64). p2p: own part first, then ranks r+1, r+2, ... mod N, summed in
    `dtype`. ring: ranks r+1, r+2, ..., r-1, the partial sums rounded to `partial_dtype` (the wire;
    default `dtype`) at every hop, then own part added last in `dtype`."""
    n = len(parts)

    def add(acc: torch.Tensor, nxt: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        if to == torch.float64:
            return acc.double() + nxt.double()
        return (acc.float() + nxt.float()).to(to)

    if impl == "p2p":
        acc = parts[rank].to(dtype).clone()
        for k in range(1, n):
            acc = add(acc, parts[(rank + k) % n], dtype)
        return acc
    hop = partial_dtype or dtype
    acc = parts[(rank + 1) % n].to(hop)
    for k in range(2, n):
        acc = add(acc, parts[(rank + k) % n], hop)
    return add(acc.to(dtype), parts[rank], dtype) if n > 1 else acc.to(dtype)


def _use(impl: str) -> None:
    """Choose the collectives for the calls that follow (the environment overrides the config)."""
    os.environ["ZERO_ENGINE_COLLECTIVES"] = {"p2p": "engine"}.get(impl, impl)


def _native(flag: bool) -> None:
    _use("native" if flag else "p2p")


def _exercise(slice_numel: int, dtype: torch.dtype) -> dict[str, object]:
    rank, n = comm.get_rank(), comm.get_world_size()
    numel = slice_numel * n
    out: dict[str, object] = {}
    for impl in IMPLS:
        _use(impl)
        assert comm.collectives_impl() == ("p2p" if impl == "ring" and n == 2 else impl)  # 2 ranks: pairwise
        before = comm.comm_stats()["bytes_sent"].get("reduce_scatter", 0)
        # Out of place, three in flight at once (as buckets are), waited for in reverse order.
        inputs = [_rank_data(rank, numel, dtype, salt=i) for i in range(3)]
        outputs = [torch.full((slice_numel,), 7.0, dtype=dtype) for _ in range(3)]
        works = [comm.reduce_scatter(o, x, async_op=True, key=i) for i, (o, x) in enumerate(zip(outputs, inputs))]
        for w in reversed(works):
            w.wait()
        out[f"{impl}.rs_bytes"] = comm.comm_stats()["bytes_sent"].get("reduce_scatter", 0) - before
        for i, o in enumerate(outputs):
            out[f"{impl}.rs{i}"] = o.clone()
        # In place: the output is this rank's slice of the input.
        buf = _rank_data(rank, numel, dtype)
        comm.reduce_scatter(buf[rank * slice_numel : (rank + 1) * slice_numel], buf)
        out[f"{impl}.rs_inplace"] = buf[rank * slice_numel : (rank + 1) * slice_numel].clone()
        # All-gather in place and out of place, two in flight.
        full = torch.zeros(numel, dtype=dtype)
        full[rank * slice_numel : (rank + 1) * slice_numel] = _rank_data(rank, slice_numel, dtype)
        other = torch.full((numel,), -1.0, dtype=dtype)
        w1 = comm.all_gather(full, full[rank * slice_numel : (rank + 1) * slice_numel], async_op=True)
        w2 = comm.all_gather(other, _rank_data(rank, slice_numel, dtype, salt=5), async_op=True)
        w2.wait()
        w1.wait()
        out[f"{impl}.ag_inplace"] = full.clone()
        out[f"{impl}.ag"] = other
    _use("p2p")
    return out


def _exercise_all(slice_numel: int) -> list[dict[str, object]]:
    return [_exercise(slice_numel, dtype) for dtype in DTYPES]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_equal_the_arithmetic_and_torch(world_size: int) -> None:
    for slice_numel in SLICES:
        per_rank = run_distributed(_exercise_all, world_size, args=(slice_numel,), timeout=300, env=SMALL_SEGMENTS)
        numel = slice_numel * world_size
        for d, dtype in enumerate(DTYPES):
            for rank, got in enumerate(r[d] for r in per_rank):
                mine = slice(rank * slice_numel, (rank + 1) * slice_numel)
                for i in range(3):
                    parts = [_rank_data(r, numel, dtype, salt=i)[mine] for r in range(world_size)]
                    # p2p and ring: bitwise their ordered sums; native (gloo's all-reduce order): float
                    # tolerance.
                    for impl in ("p2p", "ring"):
                        assert torch.equal(got[f"{impl}.rs{i}"], _ordered_sum(parts, rank, dtype, impl)), (
                            impl,
                            dtype,
                            i,
                        )
                        torch.testing.assert_close(
                            got[f"{impl}.rs{i}"].double(), got[f"native.rs{i}"].double(), **_tol(dtype)
                        )
                parts = [_rank_data(r, numel, dtype)[mine] for r in range(world_size)]
                for impl in ("p2p", "ring"):
                    assert torch.equal(got[f"{impl}.rs_inplace"], _ordered_sum(parts, rank, dtype, impl))
                    torch.testing.assert_close(
                        got["native.rs_inplace"].double(), got[f"{impl}.rs_inplace"].double(), **_tol(dtype)
                    )
                gathered = torch.cat([_rank_data(r, slice_numel, dtype) for r in range(world_size)])
                gathered5 = torch.cat([_rank_data(r, slice_numel, dtype, salt=5) for r in range(world_size)])
                for impl in IMPLS:
                    assert torch.equal(got[f"{impl}.ag_inplace"], gathered)
                    assert torch.equal(got[f"{impl}.ag"], gathered5)
                # Bytes actually sent by three reduce-scatters: (N-1)/N of the input each; gloo's
                # native one is an all-reduce, twice that.
                volume = 3 * numel * dtype.itemsize * (world_size - 1) // world_size
                assert got["p2p.rs_bytes"] == got["ring.rs_bytes"] == volume
                assert got["native.rs_bytes"] == 2 * volume


def _megabytes(slice_numel: int) -> list[torch.Tensor]:
    rank, n = comm.get_rank(), comm.get_world_size()
    x = _rank_data(rank, slice_numel * n, torch.float32)
    out = torch.empty(slice_numel)
    comm.reduce_scatter(out, x)
    full = torch.empty(slice_numel * n)
    comm.all_gather(full, out)
    return [out, full]


def test_default_segments_on_megabytes() -> None:
    slice_numel = 2_500_001  # 10 MB of fp32 per slice: three 4 MiB segments per peer
    per_rank = run_distributed(_megabytes, 2, args=(slice_numel,))
    parts = [_rank_data(r, slice_numel * 2, torch.float32) for r in range(2)]
    sums = [
        _ordered_sum([p[r * slice_numel : (r + 1) * slice_numel] for p in parts], r, torch.float32) for r in range(2)
    ]
    for rank, (out, full) in enumerate(per_rank):
        assert torch.equal(out, sums[rank]) and torch.equal(full, torch.cat(sums))


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Sums of a few N(0,1) values, each partial sum rounded to the dtype in one order or another:
    # a few units in the last place of 8 (bf16), 11 (fp16) or 24 (fp32) mantissa bits.
    ulps = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}.get(dtype, 2.0**-50)
    return {"atol": 4 * ulps, "rtol": 4 * ulps}


def _low_precision_wire(slice_numel: int) -> dict[str, torch.Tensor]:
    rank, n = comm.get_rank(), comm.get_world_size()
    numel = slice_numel * n
    x = _rank_data(rank, numel, torch.float32) * 1000 + 1  # magnitudes where bf16 sums lose digits
    out: dict[str, torch.Tensor] = {}
    before = comm.comm_stats()["bytes_sent"].get("reduce_scatter", 0)
    fp32_out = torch.empty(slice_numel)
    comm.reduce_scatter(fp32_out, x.clone(), wire_dtype=torch.bfloat16)  # bf16 bytes, float32 sum
    out["wire_bf16"] = fp32_out
    out["bytes"] = torch.tensor(comm.comm_stats()["bytes_sent"]["reduce_scatter"] - before)
    # bf16 buckets summed into a float32 row, then added to it (gradient accumulation).
    row = torch.ones(slice_numel)
    comm.reduce_scatter(row, x.to(torch.bfloat16), accumulate=True)
    out["bf16_into_fp32_acc"] = row
    # The old way: a bf16 reduce-scatter sums in bf16.
    lp = torch.empty(slice_numel, dtype=torch.bfloat16)
    comm.reduce_scatter(lp, x.to(torch.bfloat16))
    out["bf16_sum"] = lp
    _native(True)
    native = torch.empty(slice_numel)
    comm.reduce_scatter(native, x.clone(), wire_dtype=torch.bfloat16)  # emulated: bf16 all-reduce, cast
    out["native_wire_bf16"] = native
    _use("ring")  # the ring rounds its partial sums to the wire at each hop
    ring = torch.empty(slice_numel)
    comm.reduce_scatter(ring, x.clone(), wire_dtype=torch.bfloat16)
    out["ring_wire_bf16"] = ring
    row = torch.ones(slice_numel)
    comm.reduce_scatter(row, x.to(torch.bfloat16), accumulate=True)
    out["ring_bf16_into_fp32_acc"] = row
    _use("p2p")
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_low_precision_wire_sums_in_float32(world_size: int) -> None:
    slice_numel = 300_001
    per_rank = run_distributed(_low_precision_wire, world_size, args=(slice_numel,))
    numel = slice_numel * world_size
    for rank, got in enumerate(per_rank):
        mine = slice(rank * slice_numel, (rank + 1) * slice_numel)
        parts = [(_rank_data(r, numel, torch.float32) * 1000 + 1)[mine] for r in range(world_size)]
        rounded = [p.to(torch.bfloat16) for p in parts]
        want = _ordered_sum(rounded, rank, torch.float32)  # bf16 contributions, float32 additions
        assert torch.equal(got["wire_bf16"], want)
        assert torch.equal(got["bf16_into_fp32_acc"], (torch.ones(slice_numel) + want))
        ring_want = _ordered_sum(rounded, rank, torch.float32, "ring", partial_dtype=torch.bfloat16)
        assert torch.equal(got["ring_wire_bf16"], ring_want)
        # (1 + partial) + own: every float32 addition here is exact (bf16 values of magnitude ~1000)
        assert torch.equal(got["ring_bf16_into_fp32_acc"], torch.ones(slice_numel) + ring_want)
        assert int(got["bytes"]) == numel * 2 * (world_size - 1) // world_size  # bf16 bytes on the wire
        truth = sum(p.double() for p in parts)
        err_fp32_acc = (got["wire_bf16"].double() - truth).abs().mean()
        err_bf16_sum = (got["bf16_sum"].double() - truth).abs().mean()
        err_native = (got["native_wire_bf16"].double() - truth).abs().mean()
        # Rounding each contribution once beats rounding every partial sum (bf16 all-reduce).
        assert err_fp32_acc < 0.75 * err_bf16_sum and err_fp32_acc < 0.75 * err_native


def _bad_sizes() -> str:
    try:
        comm.reduce_scatter(torch.empty(3), torch.empty(7))
    except ValueError as e:
        return str(e)
    return "no error"


def test_sizes_that_do_not_divide_are_rejected_by_name() -> None:
    (msg,) = {m for m in run_distributed(_bad_sizes, 2)}
    assert "reduce_scatter: the whole buffer has 7 elements but the slice 3 x 2 ranks = 6" in msg


def _diverge(impl: str) -> str:
    _use(impl)
    rank = comm.get_rank()
    os.environ["ZERO_ENGINE_COLLECTIVE_TIMEOUT"] = "60"  # the safety net; the check must fire long before
    t0 = time.monotonic()
    try:
        comm.all_gather(torch.zeros(12), torch.zeros(4)) if rank == 1 else comm.reduce_scatter(
            torch.zeros(2), torch.zeros(6), key=3
        )
        handle = None
    except RuntimeError as e:
        handle = str(e)
    if handle is None:  # the synchronous call returned: wait happened inside; should not get here
        return "no error"
    return f"{time.monotonic() - t0:.1f}s|{handle}"


@pytest.mark.parametrize("impl", ["p2p", "ring"])
def test_ranks_issuing_different_collectives_get_an_error_naming_both(impl: str) -> None:
    per_rank = run_distributed(_diverge, 3, args=(impl,), timeout=60)
    for rank, result in enumerate(per_rank):
        took, msg = result.split("|", 1)
        assert float(took[:-1]) < 10, result
        assert "reduce_scatter(numel=6, float32, key=3) as its collective #1" in msg
        assert "all_gather(numel=12, float32, key=0) as its collective #1" in msg
        assert f"rank {rank} issued" in msg and "not issuing the same collectives" in msg


def _many_in_flight(impl: str) -> list[torch.Tensor]:
    _use(impl)
    rank, n = comm.get_rank(), comm.get_world_size()
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(6, generator=g).tolist()  # the same random completion order on every rank
    bufs = [torch.full((n * 1000,), float(rank + i)) for i in range(6)]
    works = []
    for i, b in enumerate(bufs):
        if i % 2:
            works.append(comm.all_gather(b, b[rank * 1000 : (rank + 1) * 1000], async_op=True, key=i))
        else:
            works.append(comm.reduce_scatter(b[rank * 1000 : (rank + 1) * 1000], b, async_op=True, key=i))
    for i in order:
        works[i].wait()
    return [b[rank * 1000 : (rank + 1) * 1000].clone() if i % 2 == 0 else b.clone() for i, b in enumerate(bufs)]


@pytest.mark.parametrize("impl", ["p2p", "ring"])
def test_several_collectives_in_flight_complete_in_any_order(impl: str) -> None:
    n = 3
    per_rank = run_distributed(_many_in_flight, n, args=(impl,))
    for rank, got in enumerate(per_rank):
        for i, t in enumerate(got):
            if i % 2 == 0:
                assert torch.equal(t, torch.full((1000,), float(sum(r + i for r in range(n)))))
            else:
                assert torch.equal(t, torch.cat([torch.full((1000,), float(r + i)) for r in range(n)]))


def _ring_progresses_while_computing() -> dict[str, object]:
    _use("ring")
    rank, n = comm.get_rank(), comm.get_world_size()
    x = torch.full((n * 300_000,), float(rank + 1))
    out = torch.empty(300_000)
    handle = comm.reduce_scatter(out, x, async_op=True)
    a = torch.randn(256, 256)
    t0 = time.monotonic()
    matmuls = 0
    while not handle.is_completed() and time.monotonic() - t0 < 30:  # compute, never wait
        a = torch.tanh(a @ a)
        matmuls += 1
    done_before_wait = handle.is_completed()
    handle.wait()
    return {"done_before_wait": done_before_wait, "matmuls": matmuls, "out": out}


def test_ring_collectives_complete_while_the_caller_computes() -> None:
    # The ring's steps need local work between transfers: its progress thread does it, so the
    # collective finishes without wait() being called.
    n = 3
    for got in run_distributed(_ring_progresses_while_computing, n):
        assert got["done_before_wait"], got["matmuls"]
        assert torch.equal(got["out"], torch.full((300_000,), float(sum(range(1, n + 1)))))


def test_after_a_failed_ring_collective_later_ones_fail_until_the_group_is_replaced() -> None:
    # A failed ring collective leaves transfers that can never match: every later one fails with the
    # same error instead of hanging; a new process group (destroy_process_group resets it) starts clean.
    from engine.comm.ring import _Progress

    progress, ran = _Progress(), []

    def fail() -> None:
        raise RuntimeError("rank 0 issued reduce_scatter(...) but rank 1 issued all_gather(...)")

    with pytest.raises(RuntimeError, match="rank 1 issued all_gather"):
        progress.submit(fail).wait()
    with pytest.raises(RuntimeError, match="rank 1 issued all_gather"):
        progress.submit(lambda: ran.append(1)).wait()
    assert ran == []
    progress.reset()
    assert progress.submit(lambda: ran.append(2)).wait() and ran == [2]


def _bucket_sizes() -> dict[str, object]:
    import logging

    from engine.comm.state import STATE
    from engine.config.types import ZeroConfig

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("engine").addHandler(Keep())
    logging.getLogger("engine").setLevel(logging.INFO)
    world = comm.get_world_size()
    given = bucket_sizes.resolve(ZeroConfig(reduce_bucket_size=123, allgather_bucket_size=456), 4, world)
    # Stage 0 all-gathers nothing: its unset allgather_bucket_size is not measured for.
    stage0 = bucket_sizes.resolve(ZeroConfig(reduce_bucket_size=123), 4, world, gathers=False)
    measured_before = STATE.link  # the config's values win without measuring anything
    stats_before = comm.comm_stats()
    chosen = bucket_sizes.resolve(ZeroConfig(allgather_bucket_size=789), 2, world)
    link = comm.measure_link()
    return {
        "given": given,
        "stage0": stage0,
        "measured_before": measured_before,
        "chosen": chosen,
        "link": link,
        "stats_unchanged": comm.comm_stats() == stats_before,
        "log": records,
    }


def test_bucket_sizes_come_from_the_measured_link_unless_the_config_sets_them() -> None:
    per_rank = run_distributed(_bucket_sizes, 2)
    links = [r["link"] for r in per_rank]
    assert links[0] == links[1]  # every rank takes the slowest rank's numbers: layouts agree
    link = links[0]
    assert 0 < link.latency_s < 1 and link.bandwidth_Bps > 1e6 and link.rejected is None
    want = bucket_sizes.bucket_bytes(link) // 2
    assert bucket_sizes.MIN_BUCKET_BYTES <= bucket_sizes.bucket_bytes(link) <= bucket_sizes.MAX_BUCKET_BYTES
    for rank, r in enumerate(per_rank):
        assert r["given"] == (123, 456) and r["stage0"] == (123, 500_000_000) and r["measured_before"] is None
        assert r["chosen"] == (want, 789)  # the unset one measured, the set one kept
        assert r["stats_unchanged"], "the probe's traffic is not the user's"
        logged = [m for m in r["log"] if m.startswith("bucket size")]
        if rank == 0:
            assert len(logged) == 1 and f"bucket size {want} elements" in logged[0]
            assert "for reduce_bucket_size: from the measured link: latency" in logged[0]
            assert "x the latency's worth of bytes" in logged[0]
            assert "set zero_optimization.reduce_bucket_size to choose" in logged[0]
        else:
            assert logged == []


def _collectives_config(value: str | None) -> tuple[str, int]:
    import engine

    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if value is not None:
        config["collectives"] = value
    eng, *_ = engine.initialize(model=torch.nn.Linear(4, 4), config=config)
    impl = comm.collectives_impl()
    before = comm.comm_stats()["bytes_sent"].get("reduce_scatter", 0)
    comm.reduce_scatter(torch.empty(8 // comm.get_world_size()), torch.ones(8))
    sent = comm.comm_stats()["bytes_sent"]["reduce_scatter"] - before
    eng.destroy()
    return impl, sent


@pytest.mark.parametrize(
    ("value", "world_size", "impl", "factor"),
    [
        (None, 2, "p2p", 1),
        ("engine", 2, "p2p", 1),
        ("ring", 4, "ring", 1),
        ("ring", 2, "p2p", 1),
        ("native", 2, "native", 2),
    ],
)
def test_the_config_chooses_the_collectives(value: str | None, world_size: int, impl: str, factor: int) -> None:
    # 8 fp32 elements, (N-1)/N of them sent; gloo's native reduce-scatter: twice that. With two ranks a
    # ring is the pairwise exchange.
    for got_impl, sent in run_distributed(_collectives_config, world_size, args=(value,)):
        assert got_impl == impl and sent == factor * 32 * (world_size - 1) // world_size


def test_an_unknown_collectives_value_is_refused_by_name() -> None:
    from engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="collectives"):
        load_config({"train_batch_size": 1, "collectives": "tree"}, world_size=1, world_size_source="test")


@pytest.mark.parametrize(
    ("latency_us", "mib", "transfer_us", "rejected", "bucket_mib"),
    [
        # The measurement that once gave 2097 GB/s: 2 MiB per rank "moved" in less than the latency.
        (150, 2, 140, "not clearly longer than one collective's latency (150 us)", 16),
        (150, 2, 290, "not clearly longer", 16),  # under 2 latencies: mostly noise
        (20, 64, 60, "more than any interconnect", 16),  # 64 MiB in 40 us: 1.7 TB/s
        (150, 2, 1650, None, 3.8),  # 2 MiB in 1.5 ms after latency: 1.4 GB/s; 19 x 150 us of it is 3.8 MiB
        (5, 2, 1000, None, 1),  # raised to the 1 MiB minimum
        (5000, 64, 20000, None, 256),  # cut to the 256 MiB maximum
    ],
)
def test_implausible_link_measurements_are_rejected_with_their_reason(
    latency_us: float, mib: float, transfer_us: float, rejected: str | None, bucket_mib: float
) -> None:
    link = comm.LinkSpeed.from_probe(latency_us * 1e-6, mib * 2**20, transfer_us * 1e-6)
    assert bucket_sizes.bucket_bytes(link) == pytest.approx(bucket_mib * 2**20, rel=0.01)
    if rejected is None:
        assert link.rejected is None and bucket_sizes.reason(link).startswith("from the measured link")
        bound = {1: "raised to the 1 MiB minimum", 256: "cut to the 256 MiB maximum"}.get(int(bucket_mib), "bytes)")
        assert bound in bucket_sizes.reason(link)
    else:
        assert link.rejected is not None and rejected in link.rejected
        assert bucket_sizes.reason(link) == (
            f"the link measurement was implausible ({link.rejected}), so the fallback 16 MiB"
        )
