"""Write a file so that it is either complete or absent: never half-written under its real name.

A temporary file in the same directory is written, flushed and fsynced, then renamed over the
target (rename is atomic within a file system), and the directory is fsynced so the rename itself
survives a crash. A failure leaves any earlier file of that name untouched.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def atomic_save(obj: Any, path: str) -> None:
    """torch.save(obj, path), atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
