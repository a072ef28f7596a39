"""M_D (paper section 6.3): checkpoints copied into one arena taken before the first of them.

Kept checkpoints live from their layer's forward to its recompute, interleaved with the forward's
short-lived buffers; allocated one by one they scatter among them. Here they come from one
engine.ops.arena.Arena made at the first checkpoint of a run, sized for `number_checkpoints` checkpoints
of that first one's bytes, and each returns its blocks when its recompute takes it.

A checkpoint that does not fit is kept in ordinary memory so the forward can finish and count how many
were needed; the engine then raises a ConfigError naming that count right after the forward
(engine.Engine.forward calls check()), before any gradient is touched. Code that drives the model
without the engine gets the same error at the first recompute.
"""

from __future__ import annotations

import math

import torch

from engine.activation_checkpointing import ledger
from engine.config.errors import ConfigError
from engine.ops.arena import Arena, ArenaStats, block_bytes

# The settings (settings.py) are not read here: place() is given number_checkpoints, so settings.py
# can drop the arena (reset()) without the two modules importing each other.
_KEY = "activation_checkpointing.number_checkpoints"
"""The config key the arena is sized by, named in its errors."""

_arena: Arena | None = None
_count: int | None = None
"""number_checkpoints when the arena was made (configure() drops the arena, so it is still the setting)."""
_checkpoint_bytes = 0
"""Bytes the first checkpoint took in the arena: the unit the arena was sized in."""
_overflowed = False


def place(specs: list[tuple[torch.Size, torch.dtype]], number_checkpoints: int | None) -> list[torch.Tensor] | None:
    """Arena blocks for one checkpoint's host tensors, all or none; None when the arena is full (noted
    for check()). The first call makes the arena, for `number_checkpoints` checkpoints of this size."""
    global _arena, _count, _checkpoint_bytes, _overflowed
    needed = sum(block_bytes(math.prod(shape) * dtype.itemsize) for shape, dtype in specs)
    if needed == 0:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    if _arena is None:
        _count = number_checkpoints
        _checkpoint_bytes = needed
        _arena = Arena((number_checkpoints or 0) * needed, config_key=_KEY)
    blocks = []
    try:
        for shape, dtype in specs:
            blocks.append(_arena.allocate(shape, dtype))
    except RuntimeError:  # full: the blocks taken so far return to the arena with `blocks`
        _overflowed = True
        return None
    return blocks


def check() -> None:
    """Raise the named error if a checkpoint did not fit since the last check (then forget it)."""
    global _overflowed
    if not _overflowed:
        return
    _overflowed = False
    peak = ledger.stats()
    count = _count
    needed = max(math.ceil(peak.peak_bytes / max(_checkpoint_bytes, 1)), peak.peak_checkpoints)
    raise ConfigError(
        f"{_KEY} is {count}, but this forward kept {peak.peak_checkpoints} checkpoints "
        f"alive at once ({peak.peak_bytes} bytes; the arena holds {count} of the first checkpoint's "
        f"{_checkpoint_bytes} bytes): set {_KEY} to at least {needed} (usually the number "
        "of checkpointed layers), or configure(num_checkpoints=...)"
    )


def stats() -> ArenaStats | None:
    """The arena's stats, or None before the first contiguous checkpoint."""
    return _arena.stats() if _arena is not None else None


def drop() -> None:
    """Forget the arena (its memory goes once no checkpoint holds a block of it) and any overflow."""
    global _arena, _count, _checkpoint_bytes, _overflowed
    _arena, _count, _checkpoint_bytes, _overflowed = None, None, 0, False
