"""Bytes and counts of the checkpoints alive now: what the tests and the benchmark read, and what the
contiguous arena's "number_checkpoints too small" error names.

A checkpoint's kept inputs are alive from its forward until its recompute takes them (or until the
graph holding them is dropped, e.g. a forward with no backward); a weakref.finalize on the object that
holds them decrements the counts whichever way it goes.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass


@dataclass
class LedgerStats:
    live_checkpoints: int = 0
    live_bytes: int = 0
    """Bytes this rank keeps for the checkpoints alive now (a partitioned input counts its slice)."""
    peak_checkpoints: int = 0
    peak_bytes: int = 0
    """The most bytes kept at once since the last reset_peak()."""
    whole_bytes: int = 0
    """What the same inputs would take unpartitioned, summed over the checkpoints alive at peak_bytes."""
    checkpoints: int = 0
    """Checkpoints taken since the last reset_peak()."""
    gathers: int = 0
    """All-gathers of partitioned inputs before a recompute since the last reset_peak()."""


_lock = threading.Lock()
_stats = LedgerStats()
_whole_live = 0


def add(owner: object, kept_bytes: int, whole_bytes: int) -> None:
    """Count one checkpoint's kept inputs until `owner` dies."""
    global _whole_live
    with _lock:
        _stats.live_checkpoints += 1
        _stats.live_bytes += kept_bytes
        _whole_live += whole_bytes
        _stats.checkpoints += 1
        if _stats.live_bytes > _stats.peak_bytes or _stats.live_checkpoints > _stats.peak_checkpoints:
            _stats.peak_bytes = max(_stats.peak_bytes, _stats.live_bytes)
            _stats.peak_checkpoints = max(_stats.peak_checkpoints, _stats.live_checkpoints)
            _stats.whole_bytes = max(_stats.whole_bytes, _whole_live)
    weakref.finalize(owner, _remove, kept_bytes, whole_bytes)


def _remove(kept_bytes: int, whole_bytes: int) -> None:
    global _whole_live
    with _lock:
        _stats.live_checkpoints -= 1
        _stats.live_bytes -= kept_bytes
        _whole_live -= whole_bytes


def gathered() -> None:
    with _lock:
        _stats.gathers += 1


def stats() -> LedgerStats:
    with _lock:
        return LedgerStats(**vars(_stats))


def reset_peak() -> None:
    """Peaks and counts start again from what is alive now."""
    with _lock:
        _stats.peak_checkpoints, _stats.peak_bytes = _stats.live_checkpoints, _stats.live_bytes
        _stats.whole_bytes = _whole_live
        _stats.checkpoints = _stats.gathers = 0
