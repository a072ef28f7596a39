"""Write a file so that it is either complete or absent: never half-written under its real name.

A temporary file in the same directory is written, flushed and fsynced, then renamed over the
target (rename is atomic within a file system), and the directory is fsynced so the rename itself
survives a crash. A failure leaves any earlier file of that name untouched.
"""

from __future__ import annotations

import os
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


def fsync_dir(directory: str) -> None:
    """Make renames and creations in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str) -> None:
    """torch.save(obj, path), atomically."""
    with atomic_open(path) as f:
        torch.save(obj, f)
