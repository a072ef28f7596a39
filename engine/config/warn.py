"""Warn-once for config keys that are accepted but have no effect yet.

One warning per key per process: a training script that builds several engines (or a test session)
should not repeat the same advice on every load.
"""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger("engine.config")


class ConfigWarning(UserWarning):
    """A config key this engine accepts but does not act on (yet), or a deprecated spelling."""


_warned: set[str] = set()


def warn_once(key: str, message: str, *, rank_zero_only: bool = False) -> bool:
    """Emit `message` the first time `key` is seen in this process; True when it was emitted.
    rank_zero_only: only rank 0 says it (advice about the config, the same on every rank), by the RANK the
    launcher set (engine/comm/lifecycle.py maps MPI's to it), the rule the engine logger's INFO lines follow."""
    if key in _warned:
        return False
    _warned.add(key)
    if rank_zero_only and os.environ.get("RANK", "0") != "0":
        return False
    # stacklevel 3: caller -> load_config -> here, so the warning points at the code that loaded the config.
    warnings.warn(message, ConfigWarning, stacklevel=3)
    return True


def reset_warned() -> None:
    """Forget which keys were warned about (for tests that check the once-per-process rule)."""
    _warned.clear()
