"""Bytes moved by engine/ops/aio.py's transfers, and how many went through O_DIRECT (tests that check a
transfer's path past the page cache)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from engine.ops import aio


@contextlib.contextmanager
def aio_bytes(path_part: str = "") -> Iterator[dict[str, list[int]]]:
    """{"read"/"write": [bytes, of them through O_DIRECT]} of the aio transfers waited for inside the block,
    of files whose path contains `path_part` (each transfer counted once, however often it is waited)."""
    moved: dict[str, list[int]] = {"read": [0, 0], "write": [0, 0]}
    wait = aio.IOHandle.wait

    def counted(handle: aio.IOHandle) -> int:
        n = wait(handle)
        if path_part in handle.path and not getattr(handle, "counted", False):
            handle.counted = True  # type: ignore[attr-defined]
            moved[handle.op][0] += handle.nbytes
            moved[handle.op][1] += handle.direct_bytes
        return n

    aio.IOHandle.wait = counted  # type: ignore[method-assign]
    try:
        yield moved
    finally:
        aio.IOHandle.wait = wait  # type: ignore[method-assign]
