"""The controlling zrun: start every node, relay their output, stop them all when one fails.

Each node runs `python -m launcher.zrun` in node mode (launcher/run.py), which starts the node's
torch agent and reports a failed rank as one NODE_FAILURE_TAG line. Here, one child process per
node (ssh, or this machine directly) or one for all of them (pdsh, srun, mpirun). Stopping a node
started over ssh closes its stdin: its zrun stops its ranks, and if the ssh link itself dies the
remote side sees the same end of input, so no rank outlives the job on any host.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import IO, TypedDict

from launcher.backends import BACKEND_PROGRAM, PLANNERS, NodeLaunch
from launcher.command import SHUTDOWN_TIMEOUT_S
from launcher.config import LaunchConfig
from launcher.errors import LaunchError
from launcher.node_env import exported_env
from launcher.ports import DEFAULT_PORT
from launcher.preflight import preflight_hosts
from launcher.run import NODE_FAILURE_TAG, say

# After a node is told to stop (stdin closed, or SIGTERM for pdsh/srun/mpirun) it gets this long
# to stop its ranks (its agent waits SHUTDOWN_TIMEOUT_S, then kills) before we kill its process.
STOP_GRACE_S = SHUTDOWN_TIMEOUT_S + 5
TAIL_LINES = 30


class _NodeFailure(TypedDict):
    """A node's NODE_FAILURE_TAG record (launcher/run.py's _report_failure): its root-cause rank
    (the fields of launcher.report.RankFailure), when that rank last wrote, and its report lines."""

    rank: int
    local_rank: int
    exitcode: int  # negative: killed by that signal number
    host: str
    time: str
    agent_root: bool
    t: float  # the mtime of the rank's newest log file (launcher.report.last_write)
    tail: list[str]


@dataclasses.dataclass
class _Node:
    plan: NodeLaunch
    proc: subprocess.Popen[bytes]
    tail: deque[str] = dataclasses.field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    failures: list[_NodeFailure] = dataclasses.field(default_factory=list)
    relays: list[threading.Thread] = dataclasses.field(default_factory=list)
    stop_sent: float | None = None

    def stop(self) -> None:
        """Ask once: close stdin (node zrun stops its ranks) or SIGTERM the backend's process."""
        if self.stop_sent is not None or self.proc.poll() is not None:
            return
        self.stop_sent = time.monotonic()
        if self.plan.stdin_stop and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        else:
            self.proc.send_signal(signal.SIGTERM)

    def kill_if_overdue(self) -> None:
        overdue = self.stop_sent is not None and time.monotonic() > self.stop_sent + STOP_GRACE_S
        if overdue and self.proc.poll() is None:
            self.proc.kill()


def _relay_raw(stream: io.BufferedReader, out: IO[bytes]) -> None:
    # Node 0's stdout carries global rank 0's raw output (progress bars redraw with '\r').
    # The stream is a buffered Popen pipe: read1 returns what has arrived instead of waiting to fill.
    for chunk in iter(lambda: stream.read1(65536), b""):
        out.write(chunk)
        out.flush()


def _relay_lines(node: _Node, stream: IO[bytes], out: IO[bytes], keep: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith(NODE_FAILURE_TAG):
            try:
                node.failures.append(json.loads(line[len(NODE_FAILURE_TAG) :]))
            except json.JSONDecodeError:
                pass
            continue  # reported once, by the controller, below
        if keep:
            node.tail.append(line)
        out.write(raw)
        out.flush()


def _start(plan: NodeLaunch, first: bool) -> _Node:
    proc = subprocess.Popen(
        plan.argv,
        env={**os.environ, **plan.env},
        stdin=subprocess.PIPE if plan.stdin_stop else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a terminal Ctrl-C reaches the controller only, which stops nodes once
    )
    node = _Node(plan, proc)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = sys.stdout.buffer, sys.stderr.buffer
    stdout_relay = (
        threading.Thread(target=_relay_raw, args=(proc.stdout, out), daemon=True)
        if first
        else threading.Thread(target=_relay_lines, args=(node, proc.stdout, out, False), daemon=True)
    )
    err_relay = threading.Thread(target=_relay_lines, args=(node, proc.stderr, err, True), daemon=True)
    node.relays = [stdout_relay, err_relay]
    for t in node.relays:
        t.start()
    return node


def _print_dry_run(plans: list[NodeLaunch]) -> None:
    for plan in plans:
        if plan.env:
            print(
                f"zrun: {plan.label}: environment added:",
                " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items()),
            )
        print(f"zrun: {plan.label}: {shlex.join(plan.argv)}")


def _report(nodes: list[_Node]) -> int:
    """Name the failure that came first on any node, with the end of its log; return the exit code."""
    failed = [n for n in nodes if n.proc.returncode not in (0, None)]
    # Each node reports its own root cause (launcher/report.py). Across nodes the clocks are what
    # tells: the cause stopped writing first, while the ranks it broke wrote their errors later.
    # A node's SIGTERMed rank is a victim unless nothing else failed.
    reports = [f for n in nodes for f in n.failures]
    if reports:
        f = min(reports, key=lambda r: (r.get("exitcode") == -15, float(r.get("t") or 0.0)))
        code = int(f["exitcode"])
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        say(
            f"[{f['host']} rank {f['rank']}] (local rank {f['local_rank']}) {how}, first of any node; "
            f"every node was stopped"
        )
        for line in f.get("tail") or []:
            say(str(line))
        return code if code > 0 else 128 - code
    first = min(failed, key=lambda n: n.stop_sent or 0.0)
    rc = first.proc.returncode
    say(f"{first.plan.label} exited with code {rc} before any rank failed; its last lines:")
    for line in list(first.tail)[-TAIL_LINES:]:
        print(f"zrun:   | {line}", file=sys.stderr)
    return rc if rc > 0 else (128 - rc if rc < 0 else 1)


def launch(cfg: LaunchConfig) -> int:
    """Start every node of cfg.hosts through cfg.launcher; return the job's exit code."""
    if cfg.master_port is None:
        cfg = dataclasses.replace(cfg, master_port=DEFAULT_PORT)
    program = BACKEND_PROGRAM[cfg.launcher]
    if shutil.which(program) is None and not cfg.dry_run:
        raise LaunchError(
            f"--launcher {cfg.launcher} needs `{program}`, which is not on PATH; hint: install it or pick another --launcher"
        )
    cwd, python = os.getcwd(), sys.executable
    exports = exported_env(os.environ, [os.path.expanduser("~"), cwd])
    plans = PLANNERS[cfg.launcher](cfg, exports, cwd, python)
    if cfg.dry_run:
        _print_dry_run(plans)
        return 0
    if cfg.launcher == "ssh":
        preflight_hosts(cfg, cwd, python)
    say(
        f"{len(cfg.hosts)} node(s), world size {cfg.world_size}, via {cfg.launcher}; "
        f"master {cfg.master_addr}:{cfg.master_port}; run id {cfg.run_id}"
    )
    nodes: list[_Node] = []
    stopped_by: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stopped_by:  # a second signal: no more patience
            for n in nodes:
                if n.proc.poll() is None:
                    n.proc.kill()
            return
        stopped_by.append(signum)
        for n in nodes:
            n.stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, plan in enumerate(plans):
            nodes.append(_start(plan, first=i == 0))
        while any(n.proc.poll() is None for n in nodes):
            if any(n.proc.returncode not in (0, None) for n in nodes):
                for n in nodes:
                    n.stop()  # one node failed: fail fast everywhere
            for n in nodes:
                n.kill_if_overdue()
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
            for t in n.relays:
                t.join(timeout=5)
    if stopped_by:
        say(f"stopped by {signal.Signals(stopped_by[0]).name}; every node was stopped")
        return 128 + stopped_by[0]
    if all(n.proc.returncode == 0 for n in nodes):
        return 0
    return _report(nodes)
