"""The worker side of consolidate_stream.py: runs of bytes copied (or cast) from rank files into output
files, by file descriptor, in whichever process runs them. See [Note: copying a tensor's pieces file to
file] in consolidate_stream.py.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch

from engine.checkpoint.files import CheckpointError

TASK_BYTES = 64 << 20
"""The most source bytes one worker task copies (and, when casting, holds)."""
SCAN_BYTES = 1 << 20
"""The block a worker reads a rank file in (scan_file): a multiple of every element size. Small enough to
stay in cache between the read, the CRC-32 and the write, and to hold the output's inode lock briefly:
two workers scanning 370 MB each into one output file took 2.0 s with 16 MiB blocks, 0.57 s with 4 MiB,
0.50 s with 1 MiB, 0.68 s with 256 KiB (2 cores, warm cache; 0.42-0.53 s into separate files)."""


@dataclass(frozen=True)
class Copy:
    """A run of one tensor's elements, from a rank file's bytes to an output file's."""

    tensor: str
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    numel: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype


_FILES: dict[tuple[str, int], int] = {}
"""This process's open descriptors by (path, flags), reused across tasks."""


def init_worker() -> None:
    # One thread per worker (the pool is the parallelism), as DataLoader's forked workers do: it also
    # keeps a forked child out of an OpenMP pool its parent may have started.
    torch.set_num_threads(1)
    _FILES.clear()  # the parent's descriptors are inherited, but each worker opens its own


def open_fd(path: str, flags: int) -> int:
    if (path, flags) not in _FILES:
        _FILES[(path, flags)] = os.open(path, flags)
    return _FILES[(path, flags)]


def close_files() -> None:
    for fd in _FILES.values():
        os.close(fd)
    _FILES.clear()


def tasks(copies: list[Copy]) -> list[list[Copy]]:
    """The worker tasks: every kept-dtype run into one output file is one task (writes into one file
    take its inode's lock, so two workers copying into it take turns and only add switching: they run
    in parallel on different shards); a cast run is a task of its own (the cast is the CPU's work)."""
    by_file: dict[str, list[Copy]] = {}
    cast: list[list[Copy]] = []
    for c in copies:
        if c.src_dtype == c.dst_dtype:
            by_file.setdefault(c.dst, []).append(c)
        else:
            cast.append([c])
    for runs in by_file.values():
        runs.sort(key=lambda c: (c.src, c.src_offset))
    return sorted(by_file.values(), key=len, reverse=True) + cast


def run_copies(copies: list[Copy]) -> int:
    return sum(_run_copy(c) for c in copies)


def _run_copy(c: Copy) -> int:
    """One Copy run; returns the source bytes copied."""
    try:
        src, dst = open_fd(c.src, os.O_RDONLY), open_fd(c.dst, os.O_WRONLY)
        nbytes = c.numel * c.src_dtype.itemsize
        if c.src_dtype == c.dst_dtype:
            _copy_bytes(src, c.src_offset, dst, c.dst_offset, nbytes)
        else:
            buf = bytearray(nbytes)
            if os.preadv(src, [buf], c.src_offset) != nbytes:
                raise EOFError("the file ends before the tensor's bytes do")
            cast = torch.frombuffer(buf, dtype=c.src_dtype).to(c.dst_dtype)
            pwrite(dst, cast.view(torch.uint8).numpy().data, c.dst_offset)
    except (OSError, EOFError) as err:
        raise CheckpointError(
            f"{c.src}: copying {c.numel} elements of {c.tensor!r} from byte {c.src_offset} into {c.dst} "
            f"failed ({err}); the file is truncated or the disk is full"
        ) from None
    return nbytes


def _copy_bytes(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    """nbytes from src to dst inside the kernel (copy_file_range), or by pread/pwrite where it is missing."""
    done = 0
    while done < nbytes:
        try:
            n = os.copy_file_range(src, dst, nbytes - done, src_offset + done, dst_offset + done)
        except (AttributeError, OSError) as err:  # no copy_file_range here (or across these file systems)
            if isinstance(err, OSError) and err.errno not in (18, 22, 38, 95):  # EXDEV EINVAL ENOSYS EOPNOTSUPP
                raise
            n = pwrite(
                dst, memoryview(os.pread(src, min(nbytes - done, 16 << 20), src_offset + done)), dst_offset + done
            )
        if n == 0:
            raise EOFError("the file ends before the tensor's bytes do")
        done += n


def pwrite(fd: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return done


def scan_file(task: tuple[str, tuple[list[Copy], int]]) -> tuple[str, dict[str, int], int]:
    """A rank file's first `limit` bytes read once, front to back: their CRC-32 taken and every run of
    `copies` (all from this file, all within them) written out of the same blocks, so checking a file
    and copying from it cost one read of it. Returns (path, {"crc32", "bytes"}, source bytes copied)."""
    path, (copies, limit) = task
    copies = sorted(copies, key=lambda c: c.src_offset)
    buf = bytearray(SCAN_BYTES)
    crc, pos, copied, first = 0, 0, 0, 0
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            while pos < limit and (n := os.preadv(fd, [memoryview(buf)[: min(SCAN_BYTES, limit - pos)]], pos)):
                block = memoryview(buf)[:n]
                crc = zlib.crc32(block, crc)
                while first < len(copies) and _end(copies[first]) <= pos:
                    first += 1
                for c in copies[first:]:
                    if c.src_offset >= pos + n:
                        break
                    copied += _from_block(c, block, pos)
                pos += n
        finally:
            os.close(fd)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err}); load another tag") from None
    return path, {"crc32": crc, "bytes": pos}, copied


def _end(c: Copy) -> int:
    return c.src_offset + c.numel * c.src_dtype.itemsize


def _from_block(c: Copy, block: memoryview, pos: int) -> int:
    """The part of run c that lies in block (the file's bytes from pos), written to its place."""
    a, b = max(c.src_offset, pos), min(_end(c), pos + len(block))
    if a >= b:
        return 0
    dst = open_fd(c.dst, os.O_WRONLY)
    if c.src_dtype == c.dst_dtype:
        pwrite(dst, block[a - pos : b - pos], c.dst_offset + a - c.src_offset)
    else:  # tensors start 64-byte aligned and blocks are whole elements: a and b fall between elements
        size = c.src_dtype.itemsize
        cast = torch.frombuffer(block, dtype=c.src_dtype, count=(b - a) // size, offset=a - pos).to(c.dst_dtype)
        pwrite(
            dst, cast.view(torch.uint8).numpy().data, c.dst_offset + (a - c.src_offset) // size * c.dst_dtype.itemsize
        )
    return b - a
