"""The node's agent process: torch's elastic agent, tied to zrun's life and quiet when told to stop.

`python -m launcher.agent ARGS` runs `torch.distributed.run ARGS` in this process, with two changes:

- The kernel sends it SIGTERM when zrun dies, even by `kill -9` (PR_SET_PDEATHSIG), and the agent
  then stops its ranks as for any SIGTERM: no rank outlives zrun holding the port, and zrun's
  temporary log folder is removed, as when a user stops a job. The signal is tied to the *thread*
  that forked us, not the process; zrun starts the agent from the thread that then waits for it
  (launcher/run.py), so that thread can only end with zrun itself.
- The agent acts on the first stop signal only. The kernel sends the parent-death signal again each
  time the agent is handed from one of zrun's dying threads to the next, and a user or a scheduler
  may signal twice; torch's handler raises on every one, and a repeat that lands inside torch's own
  shutdown aborts it half-way (ranks not yet killed, log tailer threads left running, which then
  hold the agent's exit forever). Repeats are ignored: the shutdown underway is bounded by
  --shutdown-timeout, and zrun kills what outlives its own deadline.
- A stop signal ends the agent with 128+N and no traceback (zrun prints the one summary line), and
  a failed rank is reported as one FAILURES_TAG line of JSON for zrun's report instead of torch's
  ChildFailedError traceback and summary block.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only after PR_SET_PDEATHSIG is in place
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# zrun passes its pid so a zrun that died before PR_SET_PDEATHSIG took effect is noticed too.
PARENT_ENV = "ZRUN_AGENT_PARENT"
# zrun's own temporary log folder (not a user's --log_dir): removed here if zrun died, as zrun
# itself removes it when the user stops a job.
TEMP_LOG_DIR_ENV = "ZRUN_AGENT_TEMP_LOG_DIR"
FAILURES_TAG = "ZRUN_AGENT_FAILURES "
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        sys.exit(128 + signal.SIGTERM)  # zrun is already gone: start nothing


def act_on_first_stop_signal_only() -> None:
    """Wrap torch's stop-signal handler (the one PContext.start installs) so only the first signal raises."""
    from torch.distributed.elastic.multiprocessing import api

    torch_handler = api._terminate_process_handler
    received: list[int] = []

    def first_only(signum: int, frame: FrameType | None) -> None:
        if received:
            return  # a repeat: the shutdown the first one started is under way
        received.append(signum)
        torch_handler(signum, frame)

    api._terminate_process_handler = first_only  # looked up by name when PContext.start installs it


def failures_line(err: ChildFailedError) -> str:
    """One JSON line naming every failed rank; `root` marks the agent's own pick of the first failure."""
    root_rank, _ = err.get_first_failure()
    records = [
        {
            "rank": rank,
            "local_rank": f.local_rank,
            "exitcode": f.exitcode,
            "host": socket.getfqdn(),  # as torch's own summary names it
            # Whole seconds; the report breaks ties with the log files' write times.
            "time": f.timestamp_isoformat(),
            "root": rank == root_rank,
        }
        for rank, f in sorted(err.failures.items())
    ]
    return FAILURES_TAG + json.dumps(records)


def main(argv: Sequence[str]) -> int:
    # Popped: the ranks inherit this environment and are not agents.
    parent_value, temp_log_dir = os.environ.pop(PARENT_ENV, ""), os.environ.pop(TEMP_LOG_DIR_ENV, None)
    parent = int(parent_value) if parent_value.isdigit() else None
    die_with_parent(parent)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    act_on_first_stop_signal_only()

    try:
        run(parse_args(list(argv)))
    except SignalException as e:
        # The agent already stopped its ranks (torch's agent does so before re-raising).
        if temp_log_dir and parent is not None and os.getppid() != parent:
            shutil.rmtree(temp_log_dir, ignore_errors=True)  # zrun is gone: nobody else will
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(failures_line(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
