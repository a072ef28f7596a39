"""Write a file so that it is either complete or absent: never half-written under its real name.

A temporary file in the same directory is written, flushed and fsynced, then renamed over the
target (rename is atomic within a file system), and the directory is fsynced so the rename itself
survives a crash. A failure leaves any earlier file of that name untouched.
"""

from __future__ import annotations

import os
import struct
import zipfile
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
    """A file's write() that also takes the CRC-32 of every byte written (torch.save streams into it),
    and keeps it at the end of every write, so the CRC-32 of the file's first N bytes is known for any
    N where a write ended (torch.save writes each storage's bytes with one write)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self.crc32, self.size = f, 0, 0
        self.prefix_crc32: dict[int, int] = {0: 0}

    def write(self, data: bytes) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        self.prefix_crc32[self.size] = self.crc32
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: str) -> dict[str, Any]:
    """torch.save(obj, path), atomically; returns {"crc32", "bytes"} of the file, taken while writing
    (CRC-32 runs at ~6.5 GB/s here: ~5% of a 300 MB save, where reading the file back to hash it after
    would add a second pass), and "first_storage": {"offset", "bytes", "crc32"} when the file holds a
    storage: where the bytes of the first one obj pickles lie ([offset, offset + bytes)) and the CRC-32
    of the file up to their end (its zip headers, the pickle and that storage), so a reader that needs
    only that storage can check only those bytes (the optimizer file's masters, store.py)."""
    with atomic_open(path) as f:
        writer = _Crc32Writer(f)
        # torch.save takes any object with write() and flush() (its docstring says so), but its
        # annotation names only str, PathLike and IO[bytes].
        torch.save(obj, writer)  # type: ignore[arg-type]
    digest: dict[str, Any] = {"crc32": writer.crc32, "bytes": writer.size}
    span = first_storage_span(path)
    if span is not None and sum(span) in writer.prefix_crc32:
        digest["first_storage"] = {"offset": span[0], "bytes": span[1], "crc32": writer.prefix_crc32[sum(span)]}
    return digest


def first_storage_span(path: str) -> tuple[int, int] | None:
    """(byte offset, size) of the data of the first storage torch.save wrote into `path` (the zip
    record <archive>/data/0, stored uncompressed), read from the zip's directory; None if there is none."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        info = next((i for i in archive.infolist() if i.filename.endswith("/data/0")), None)
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            return None
        f.seek(info.header_offset)
        local = f.read(30)  # the local header: its name and extra-field lengths end it
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        return info.header_offset + 30 + name_len + extra_len, info.file_size


def file_crc32(path: str, chunk: int = 16 << 20) -> dict[str, int]:
    """{"crc32", "bytes"} of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": crc, "bytes": size}
