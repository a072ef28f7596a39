"""Async file I/O (engine/ops/aio.py, csrc/cpu/aio.cpp) on both back-ends: round trips, O_DIRECT for
aligned transfers, short reads named, the aio section's keys.

The compiled runs set ZERO_ENGINE_OPS=require and ask for backend "compiled", so a broken build fails
them instead of testing the fallback twice. A full disk is tested in tests/test_swap_files.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.ops import aio, builder

BACKENDS = ["compiled", "python"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(builder.ENV_MODE, "require" if request.param == "compiled" else "fallback")
    builder.reset_for_tests()
    yield request.param
    builder.reset_for_tests()


def context(backend: str, **kw: int | bool) -> aio.AioContext:
    # Small blocks so that every transfer here is split over several threads and claims.
    config = aio.AioConfig(**{"block_size": 8192, "queue_depth": 2, "thread_count": 3, **kw}, backend=backend)
    ctx = aio.AioContext(config)
    assert ctx.backend == backend
    return ctx


def sized_file(path: Path, nbytes: int) -> aio.OpenFile:
    file = aio.open_file(path, create=True)
    os.ftruncate(file.fd, nbytes)
    return file


# (elements, element offset into the file, aligned buffer); fp32 and bf16 sizes in bytes:
# 65536 elements = 256 KiB / 128 KiB (aligned), 12345 and 3 elements and offset 77 (not); each case
# has its own 512 KiB slot of the file.
CASES = [(65536, 0, True), (65536, 1024, True), (12345, 77, False), (3, 5, False), (40000, 1, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trips_several_in_flight(backend: str, dtype: torch.dtype, tmp_path: Path) -> None:
    torch.manual_seed(0)
    size = torch.empty((), dtype=dtype).element_size()
    with context(backend) as ctx:
        file = sized_file(tmp_path / "swap", 1 << 22)
        sources, writes = [], []
        for numel, element_offset, aligned in CASES:
            src = aio.aligned_empty(numel, dtype) if aligned else torch.empty(numel, dtype=dtype)
            src.copy_(torch.randn(numel))
            sources.append(src)
            writes.append(ctx.write(file, src, len(writes) * (1 << 19) + element_offset * size))
        assert [w.wait() for w in writes] == [s.numel() * size for s in sources]
        outs = [
            aio.aligned_empty(s.numel(), dtype) if a else torch.empty_like(s) for s, (_, _, a) in zip(sources, CASES)
        ]
        reads = [ctx.read(file, out, w.offset) for out, w in zip(outs, writes)]
        for read, out, src, (_, element_offset, aligned) in zip(reads, outs, sources, CASES):
            assert read.wait() == src.numel() * size
            assert torch.equal(out, src)
            fully_aligned = aligned and (read.offset % aio.DIRECT_ALIGN == 0) and read.nbytes % aio.DIRECT_ALIGN == 0
            if file.direct_fd >= 0 and fully_aligned:
                assert read.direct_bytes == read.nbytes  # aligned: every block through O_DIRECT
            if not aligned:
                assert read.direct_bytes == 0  # the buffer's address is not 4096-aligned
        file.close()


def test_single_submit_and_one_thread_give_the_same_bytes(backend: str, tmp_path: Path) -> None:
    data = torch.randn(50_001)
    for kw in ({"single_submit": True}, {"thread_count": 1, "queue_depth": 1}, {"block_size": 1 << 20}):
        with context(backend, **kw) as ctx:
            file = sized_file(tmp_path / f"f{len(os.listdir(tmp_path))}", data.numel() * 4 + 100)
            handle = ctx.write(file, data, 100)
            while not handle.done():  # done() polls without blocking; wait() then returns at once
                time.sleep(0.001)
            assert handle.wait() == data.numel() * 4 and handle.done()
            out = torch.empty_like(data)
            ctx.read(file, out, 100).wait()
            assert torch.equal(out, data)
            file.close()


def test_a_read_past_the_end_is_a_named_error(backend: str, tmp_path: Path) -> None:
    with context(backend) as ctx:
        file = sized_file(tmp_path / "short", 40_000)
        handle = ctx.read(file, torch.empty(10_000), 4)  # 40,000 bytes at offset 4: 4 bytes past the end
        with pytest.raises(aio.AioError) as caught:
            handle.wait()
        error = caught.value
        assert (error.path, error.offset, error.expected, error.got) == (str(tmp_path / "short"), 4, 40_000, 39_996)
        assert "end of file" in str(error) and "moved 39996 bytes" in str(error) and str(tmp_path) in str(error)
        file.close()


def test_a_failed_call_names_the_buffer_and_the_closed_file(backend: str, tmp_path: Path) -> None:
    ctx = context(backend)
    file = sized_file(tmp_path / "f", 4096)
    with pytest.raises(ValueError, match="contiguous CPU tensor, got a non-contiguous tensor"):
        ctx.write(file, torch.zeros(4, 4).t(), 0)
    with pytest.raises(ValueError, match="offset must be a non-negative integer"):
        ctx.write(file, torch.zeros(4), -1)
    file.close()
    with pytest.raises(ValueError, match="the file is closed"):
        ctx.read(file, torch.zeros(4), 0)
    ctx.close()
    with pytest.raises(RuntimeError, match="AioContext is closed"):
        ctx.read(sized_file(tmp_path / "g", 16), torch.zeros(4), 0)


def test_deepspeed_aio_section() -> None:
    section = {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2, "single_submit": False}
    config = aio.AioConfig.from_section({**section, "overlap_events": True, "use_gds": False})
    assert (config.block_size, config.queue_depth, config.thread_count) == (262144, 4, 2)
    assert config.threads == 8  # DeepSpeed's requests in flight: 2 threads x queue depth 4
    assert aio.AioConfig.from_section({"thread_count": 3, "single_submit": True}).threads == 24
    assert aio.AioConfig.from_section({"queue_depth": 128}).threads == aio.MAX_THREADS
    assert aio.AioConfig.from_section({}) == aio.AioConfig()  # DeepSpeed's defaults
    with pytest.raises(ValueError, match="aio.queue_dpeth: not a key"):
        aio.AioConfig.from_section({"queue_dpeth": 4})
    with pytest.raises(ValueError, match="name the same setting"):
        aio.AioConfig.from_section({"thread_count": 2, "intra_op_parallelism": 4})
    with pytest.raises(ValueError, match="aio.use_gds"):
        aio.AioConfig.from_section({"use_gds": True})
    with pytest.raises(ValueError, match="aio.block_size must be a positive integer, got 0"):
        aio.AioConfig(block_size=0)
    with pytest.raises(TypeError, match="aio.single_submit must be true or false"):
        aio.AioConfig(single_submit=1)  # type: ignore[arg-type]
