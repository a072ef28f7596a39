"""Write a file so that it is either complete or absent: never half-written under its real name.

A temporary file in the same directory is written, flushed and fsynced, then renamed over the
target (rename is atomic within a file system), and the directory is fsynced so the rename itself
survives a crash. A failure leaves any earlier file of that name untouched.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch


@contextmanager
def atomic_open(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """open(path, mode) for writing, atomically: the file appears complete at `path` when the block
    exits, or not at all if it raises."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_path(path: str) -> None:
    """Make a file's data, or renames and creations in a directory, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make renames and creations in `directory` durable."""
    fsync_path(directory)


class _Crc32Writer:
    """A file's write() that also takes the CRC-32 of every byte written (torch.save streams into it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self.crc32, self.size = f, 0, 0

    def write(self, data: bytes) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: str) -> dict[str, int]:
    """torch.save(obj, path), atomically; returns {"crc32", "bytes"} of the file, taken while writing
    (CRC-32 runs at ~6.5 GB/s here: ~5% of a 300 MB save, where reading the file back to hash it after
    would add a second pass)."""
    with atomic_open(path) as f:
        writer = _Crc32Writer(f)
        # torch.save takes any object with write() and flush() (its docstring says so), but its
        # annotation names only str, PathLike and IO[bytes].
        torch.save(obj, writer)  # type: ignore[arg-type]
    return {"crc32": writer.crc32, "bytes": writer.size}


def file_crc32(path: str, chunk: int = 16 << 20) -> dict[str, int]:
    """{"crc32", "bytes"} of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": crc, "bytes": size}
