"""Giving freed heap memory back to the OS (glibc's malloc_trim), for code that frees large buffers and needs the
process's resident memory to fall with them: zero.Init after each module's whole values are partitioned, and
offload_states after the storages it moved are shrunk.

glibc raises its mmap threshold after the first large free, so later large buffers come from the heap,
interleaved with small allocations that stay; without a trim the freed holes stay resident (zero.Init measured a
rank's peak while building up to the whole model, 0.33-1.1x on 4 ranks for a 400 MB model, instead of its
quarter). Other allocators return memory by themselves: there it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def return_freed_memory() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)
