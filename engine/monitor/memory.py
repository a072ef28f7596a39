"""`memory_breakdown`: one progress-log line with the stage's model-state bytes per category and the
process's peak RSS, so a run shows where its memory goes and how far it is from the estimate
(`python -m engine.estimate`)."""

from __future__ import annotations

import resource
import sys

MODEL_STATES = ("params", "master", "gradients", "optimizer_state")
"""memory_report() categories that are model states (the paper's Table 1); the rest are buffers."""


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory_line(report: dict[str, int], numel: int, rank: int) -> str:
    """'memory rank 0 | params .. | master .. | gradients .. | optimizer_state .. | model states ..
    (x B/param) | <buffers> | peak RSS ..'."""
    states = sum(report.get(k, 0) for k in MODEL_STATES)
    parts = [f"{k} {_mib(report.get(k, 0))}" for k in MODEL_STATES]
    per_param = f" ({states / numel:.2f} B/param)" if numel else ""
    parts.append(f"model states {_mib(states)}{per_param}")
    parts += [f"{k} {_mib(v)}" for k, v in report.items() if k not in MODEL_STATES]
    parts.append(f"peak RSS {_mib(peak_rss_bytes())}")
    return f"memory rank {rank} | " + " | ".join(parts)
