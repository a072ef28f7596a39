"""Which rank failed (from the agent's failure report) and the tail of that rank's log files."""

from __future__ import annotations

import glob
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from launcher.agent import FAILURES_TAG

# The agent kills the surviving ranks with these; such a rank is a victim, not a cause.
_AGENT_KILLS = (-15, -9)
# The agent's log line when it starts stopping the surviving ranks after a failure.
_STOPPING = re.compile(r"Sending process \d+ closing signal")


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int  # negative: killed by that signal number
    host: str
    time: str = ""  # the agent's observation time, to the second (YYYY-MM-DD_HH:MM:SS)
    agent_root: bool = False

    def describe(self) -> str:
        how = f"was killed by signal {-self.exitcode}" if self.exitcode < 0 else f"exited with code {self.exitcode}"
        return f"[{self.host} rank {self.rank}] (local rank {self.local_rank}) {how}"

    def zrun_exit_code(self) -> int:
        # The failing rank's code, shell-style 128+N for a signal, never 0 for a failure.
        return self.exitcode if self.exitcode > 0 else (128 - self.exitcode if self.exitcode < 0 else 1)


class FailureParser:
    """Fed the agent's stderr line by line: the failed ranks (launcher/agent.py's one JSON line) and
    when the agent began stopping the survivors.

    Rank output echoed by the agent is prefixed `[rankN]:`, so a rank printing look-alike lines is
    never taken for the agent's.
    """

    def __init__(self) -> None:
        self.failures: list[RankFailure] = []
        # monotonic time at which the agent began stopping ranks (set by the relay thread).
        self.stopping_since: float | None = None

    def feed(self, line: str) -> bool:
        """Take one line; True when it was the agent's report to zrun (not for the console)."""
        if line.startswith(FAILURES_TAG):
            try:
                records = json.loads(line[len(FAILURES_TAG) :])
                self.failures = [
                    RankFailure(
                        int(r["rank"]),
                        int(r["local_rank"]),
                        int(r["exitcode"]),
                        str(r["host"]),
                        str(r["time"]),
                        bool(r["root"]),
                    )
                    for r in records
                ]
            except (ValueError, KeyError, TypeError):
                return False  # not ours after all: show it
            return True
        if self.stopping_since is None and not line.startswith("[") and _STOPPING.search(line):
            self.stopping_since = time.monotonic()
        return False


def pick_root_cause(failures: list[RankFailure], last_write: Callable[[RankFailure], float]) -> RankFailure | None:
    """The rank that failed first.

    The agent's own pick is unreliable when several ranks fail within one second (its timestamps
    are whole seconds and ties go to the lowest rank): a rank whose collective broke *because* a
    peer died looks just like the cause. Ranks the agent killed itself are not the cause: a rank
    that exited on its own comes first, then one SIGKILLed (the agent only escalates to SIGKILL
    after a failure, so a lone SIGKILL came from outside: the OOM killer, a user), then SIGTERMed
    ones (the agent's first signal to the survivors). Within a kind, the earliest second wins, then
    the one whose log files stopped changing first.
    """
    if not failures:
        return None
    return min(failures, key=lambda f: (kill_rank(f.exitcode), f.time, last_write(f), not f.agent_root))


def kill_rank(exitcode: int) -> int:
    """0: exited on its own, 1: SIGKILL, 2: SIGTERM; lower is more likely the root cause."""
    return _AGENT_KILLS[::-1].index(exitcode) + 1 if exitcode in _AGENT_KILLS else 0


def rank_log_files(log_dir: str, run_id: str, local_rank: int) -> list[str]:
    """torchrun 2.x writes <log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log."""
    attempts = sorted(
        glob.glob(os.path.join(glob.escape(log_dir), glob.escape(run_id) + "_*", "attempt_*")),
        key=lambda p: int(p.rsplit("_", 1)[1]) if p.rsplit("_", 1)[1].isdigit() else -1,
    )
    if not attempts:
        return []
    rank_dir = os.path.join(attempts[-1], str(local_rank))
    return [
        os.path.join(rank_dir, n) for n in ("stdout.log", "stderr.log") if os.path.exists(os.path.join(rank_dir, n))
    ]


def tail(path: str, n: int = 20) -> list[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))  # the last lines of a huge log without reading it all
        lines = f.read().decode("utf-8", "replace").splitlines()
    return lines[-n:]


def last_write(log_dir: str, run_id: str, local_rank: int) -> float:
    """When the rank's logs were last written (0.0 if there are none)."""
    return max((os.path.getmtime(p) for p in rank_log_files(log_dir, run_id, local_rank)), default=0.0)
