"""Process-tree housekeeping so that no rank outlives zrun.

torch's agent starts every rank in its own session, so a signal to the agent's process group does
not reach the ranks; if the agent dies without stopping them they would be orphaned. zrun makes
itself a child subreaper (Linux) so such orphans become its children, and kills them at the end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> ppid for every process we can see in /proc (empty where there is no /proc)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # The command name is in parentheses and may contain spaces: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        out[int(name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    parents = _parents()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found.extend(kids)
        frontier.extend(kids)
    return found


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> list[int]:
    killed = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def reap_children() -> None:
    """Collect exit statuses of adopted orphans so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
