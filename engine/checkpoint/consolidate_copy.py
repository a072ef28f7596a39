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


def tasks(copies: list[Copy]) -> list[tuple[str, tuple[list[Copy], None]]]:
    """The worker tasks of runs whose files have no checksum to check: each a source file's runs, in file
    order, up to TASK_BYTES of them (one rank file's runs are shared by several workers), the largest
    first; scan_file reads just the runs' bytes."""
    by_src: dict[str, list[Copy]] = {}
    for c in copies:
        by_src.setdefault(c.src, []).append(c)
    out: list[tuple[str, tuple[list[Copy], None]]] = []
    for path, runs in by_src.items():
        runs.sort(key=lambda c: c.src_offset)
        chunk: list[Copy] = []
        size = 0
        for c in runs:
            if chunk and size + _bytes(c) > TASK_BYTES:
                out.append((path, (chunk, None)))
                chunk, size = [], 0
            chunk.append(c)
            size += _bytes(c)
        if chunk:
            out.append((path, (chunk, None)))
    return sorted(out, key=lambda task: sum(_bytes(c) for c in task[1][0]), reverse=True)


def pwrite(fd: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return done


def scan_file(task: tuple[str, tuple[list[Copy], int | None]]) -> tuple[str, dict[str, int], int]:
    """Runs of one rank file written out of blocks of SCAN_BYTES read front to back. With a `limit`, the
    file's first `limit` bytes are read whole and their CRC-32 taken on the way (every run lies within
    them), so checking a file and copying from it cost one read of it; with None, only the runs' bytes
    are read (DeepSpeed's files, verify=False). Large sequential reads also bring a cold file in at the
    disk's speed, where copy_file_range (the kernel's page-cache readahead) took 25% longer here.
    Returns (path, {"crc32", "bytes"}: what a check compares, source bytes copied)."""
    path, (copies, limit) = task
    copies = sorted(copies, key=lambda c: c.src_offset)
    spans = [(0, limit)] if limit is not None else _spans(copies)
    view = memoryview(bytearray(SCAN_BYTES))
    crc, pos, copied, first = 0, 0, 0, 0
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in spans:
                pos = start
                while pos < end and (n := os.preadv(fd, [view[: min(SCAN_BYTES, end - pos)]], pos)):
                    block = view[:n]
                    if limit is not None:
                        crc = zlib.crc32(block, crc)
                    while first < len(copies) and _end(copies[first]) <= pos:
                        first += 1
                    for c in copies[first:]:
                        if c.src_offset >= pos + n:
                            break
                        copied += _from_block(c, block, pos)
                    pos += n
                if limit is None and pos < end:  # a checked file's short read is the check's to name
                    raise EOFError(f"the file ends at byte {pos}, before the tensors' bytes up to byte {end} do")
        finally:
            os.close(fd)
    except (OSError, EOFError) as err:
        raise CheckpointError(
            f"{path} cannot be read ({err}); the file is truncated or unreadable: load another tag"
        ) from None
    return path, {"crc32": crc, "bytes": pos}, copied


def _bytes(c: Copy) -> int:
    return c.numel * c.src_dtype.itemsize


def _spans(copies: list[Copy]) -> list[tuple[int, int]]:
    """The byte ranges the runs (sorted by offset) cover, touching or overlapping ones merged."""
    spans: list[tuple[int, int]] = []
    for c in copies:
        if spans and c.src_offset <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], _end(c)))
        else:
            spans.append((c.src_offset, _end(c)))
    return spans


def _end(c: Copy) -> int:
    return c.src_offset + _bytes(c)


def _from_block(c: Copy, block: memoryview, pos: int) -> int:
    """The part of run c that lies in block (the file's bytes from pos), written to its place."""
    a, b = max(c.src_offset, pos), min(_end(c), pos + len(block))
    if a >= b:
        return 0
    try:
        dst = open_fd(c.dst, os.O_WRONLY)
        if c.src_dtype == c.dst_dtype:
            pwrite(dst, block[a - pos : b - pos], c.dst_offset + a - c.src_offset)
        else:  # runs start on whole elements and blocks are whole elements: a and b fall between elements
            size = c.src_dtype.itemsize
            cast = torch.frombuffer(block, dtype=c.src_dtype, count=(b - a) // size, offset=a - pos).to(c.dst_dtype)
            at = c.dst_offset + (a - c.src_offset) // size * c.dst_dtype.itemsize
            pwrite(dst, cast.view(torch.uint8).numpy().data, at)
    except OSError as err:
        raise CheckpointError(
            f"{c.dst}: writing {c.tensor!r} failed ({err}); free space on its file system or write the output "
            "elsewhere (nothing is renamed into place: the earlier output, if any, is intact)"
        ) from None
    return b - a
