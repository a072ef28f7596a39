"""engine/offload/staged_writes.py: writes through O_DIRECT from a ring of reused aligned buffers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from aio_bytes import aio_bytes

from engine.offload.staged_writes import StagedWriter
from engine.ops.aio import DIRECT_ALIGN, AioConfig, AioContext, AioError, OpenFile, open_file


def test_writes_land_bitwise_at_their_offsets_through_o_direct(tmp_path: Path) -> None:
    path = tmp_path / "grad.swp"
    path.write_bytes(b"\xff" * (1 << 20))
    file = open_file(path)
    with AioContext(AioConfig(block_size=DIRECT_ALIGN * 2, thread_count=2)) as context, aio_bytes() as moved:
        writer = StagedWriter(context, chunk_bytes=3 * DIRECT_ALIGN, buffers=2)  # more chunks than buffers
        a = torch.randn(10_000)  # 40,000 bytes: 4 chunks, the last not a whole number of 4 KiB
        b = torch.randn(3 * DIRECT_ALIGN // 2, dtype=torch.bfloat16)
        a_bits = a.clone()
        writer.write(file, a[1000:5000], 0)
        a.zero_()  # the values may change once write() returns: they are staged
        writer.write(file, b, 16 * DIRECT_ALIGN)
        writer.wait_all()
        assert writer.bytes_written == 4000 * 4 + b.numel() * 2
    data = path.read_bytes()
    assert data[:16_000] == a_bits[1000:5000].numpy().tobytes()
    assert data[16_000 : 16 * DIRECT_ALIGN] == b"\xff" * (16 * DIRECT_ALIGN - 16_000)  # untouched between
    assert data[16 * DIRECT_ALIGN : 16 * DIRECT_ALIGN + 3 * DIRECT_ALIGN] == b.view(torch.uint8).numpy().tobytes()
    assert len(data) == 1 << 20
    if file.direct_fd >= 0:  # all but the partial last 4 KiB block of the first write went direct
        written, direct = moved["write"]
        assert written == 16_000 + 3 * DIRECT_ALIGN
        assert direct == written - 16_000 % DIRECT_ALIGN, moved
    file.close()


def test_an_unaligned_offset_and_a_bad_chunk_size_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.swp"
    path.write_bytes(bytes(DIRECT_ALIGN * 4))
    file = open_file(path)
    with AioContext() as context:
        with pytest.raises(ValueError, match="multiple of 4096"):
            StagedWriter(context, chunk_bytes=1000)
        with pytest.raises(ValueError, match="offset 100 is not a multiple of 4096"):
            StagedWriter(context).write(file, torch.ones(4), 100)
    file.close()


def test_a_failed_write_is_raised_after_every_write_ended_and_the_writer_works_again(tmp_path: Path) -> None:
    path = tmp_path / "f.swp"
    path.write_bytes(bytes(DIRECT_ALIGN * 8))
    read_only = OpenFile(str(path), os.open(path, os.O_RDONLY), -1)  # every write fails (EBADF)
    good = open_file(path)
    with AioContext() as context:
        writer = StagedWriter(context, chunk_bytes=DIRECT_ALIGN, buffers=2)
        writer.write(read_only, torch.ones(DIRECT_ALIGN // 4), 0)
        with pytest.raises(AioError, match=str(path)):
            writer.wait_all()
        writer.write(good, torch.full((DIRECT_ALIGN // 4,), 2.0), DIRECT_ALIGN)  # the ring is whole again
        writer.wait_all()
    assert path.read_bytes()[DIRECT_ALIGN : 2 * DIRECT_ALIGN] == torch.full((DIRECT_ALIGN // 4,), 2.0).numpy().tobytes()
    read_only.close()
    good.close()
