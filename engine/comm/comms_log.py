"""DeepSpeed's comms-logger calls (deepspeed.comm.configure, log_summary, reset_log, ...) over the
engine's own counts, comm_stats().

The engine counts every collective's calls and bytes always, so configure() has nothing to switch on
and accepts DeepSpeed's arguments only to ignore them; it times nothing, so log_summary() reports calls
and bytes, not latencies or bandwidths (DeepSpeed's table). None of these communicates.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.comm.collectives import comm_stats
from engine.comm.lifecycle import get_rank
from engine.comm.state import STATE

logger = logging.getLogger("engine")


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Accepted for DeepSpeed's scripts; the counts behind log_summary() are always kept."""


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, dict[str, int]] | None:
    """Log this rank's calls and bytes sent per collective (rank 0 logs); with return_dict, return
    comm_stats() too. show_straggler is accepted and ignored (nothing is timed)."""
    stats = comm_stats()
    if get_rank() == 0:
        for op in sorted(stats["calls"]):
            logger.info("comm %s: %d calls, %d bytes sent", op, stats["calls"][op], stats["bytes_sent"].get(op, 0))
    return stats if return_dict else None


def reset_log() -> None:
    """Start the counts afresh (comm_stats() is empty after it)."""
    STATE.bytes_sent.clear()
    STATE.calls.clear()


def has_comm_data() -> bool:
    return bool(STATE.calls)


def get_comm_operation_count() -> int:
    return sum(STATE.calls.values())


def get_logged_comm_ops() -> list[str]:
    return sorted(STATE.calls)
