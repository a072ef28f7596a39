"""Run one node's agent: start it, relay its output, stop it on signals, report the failed rank."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import IO

from launcher.command import SHUTDOWN_TIMEOUT_S, build_agent_command
from launcher.config import LaunchConfig
from launcher.errors import LaunchError
from launcher.mirror import Rank0Mirror
from launcher.ports import DEFAULT_PORT, free_port, port_is_free
from launcher.procs import become_subreaper, descendants, kill_pids, reap_children
from launcher.report import FailureParser, RankFailure, last_write, pick_root_cause, rank_log_files, tail
from launcher.threads import available_cores

TAIL_LINES = 20


def say(msg: str) -> None:
    print(f"zrun: {msg}", file=sys.stderr, flush=True)


def resolve_port(cfg: LaunchConfig) -> LaunchConfig:
    if cfg.master_port is not None:
        if not cfg.dry_run and not port_is_free(cfg.master_port):
            raise LaunchError(
                f"[localhost] --master_port {cfg.master_port} is already in use; "
                f"hint: pick another port, or omit --master_port to get a free one"
            )
        return cfg
    port = DEFAULT_PORT
    if not cfg.dry_run and not port_is_free(port):
        port = free_port()
        say(f"port {DEFAULT_PORT} is busy, using free port {port} (pass --master_port to choose)")
    return dataclasses.replace(cfg, master_port=port)


def _relay(stream: IO[bytes], parser: FailureParser) -> None:
    # The agent's stderr carries the ranks' tee'd stderr and its own failure summary: echo every
    # line at once and let the parser pick out the root cause.
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        sys.stderr.write(line)
        sys.stderr.flush()
        parser.feed(line.rstrip("\n"))


class _Stopper:
    """SIGINT/SIGTERM: forward to the agent's process group once; a second signal kills at once."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.signum: int | None = None
        self.deadline = float("inf")
        self.pids: set[int] = set()

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        # Snapshot the tree now: once the agent is gone, its ranks are no longer findable by parent.
        self.pids.update(descendants(self.proc.pid))
        if self.signum is None:
            self.signum = signum
            # The agent SIGTERMs its ranks and SIGKILLs them after SHUTDOWN_TIMEOUT_S; give it that.
            self.deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S + 5
            self._send(signum)
        else:
            self.kill_all()

    def _send(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_all(self) -> None:
        self.pids.update(descendants(self.proc.pid))
        self._send(signal.SIGKILL)
        kill_pids(sorted(self.pids))


def _report_failure(failure: RankFailure, cfg: LaunchConfig, log_dir: str, kept: bool) -> None:
    say(f"{failure.describe()}; the agent stopped the other ranks")
    if not failure.agent_root:
        say("(torch's summary above names another rank as root cause; it could not tell which failed first)")
    for path in rank_log_files(log_dir, cfg.run_id, failure.local_rank):
        lines = tail(path, TAIL_LINES)
        if lines:
            say(f"last {len(lines)} lines of rank {failure.rank}'s {os.path.basename(path)[:-4]}:")
            for line in lines:
                print(f"zrun:   | {line}", file=sys.stderr)
    say(f"hint: per-rank logs are in {log_dir}" + ("" if kept else " (a temporary directory, kept)"))


def run(cfg: LaunchConfig) -> int:
    cfg = resolve_port(cfg)
    own_log_dir = cfg.log_dir is None
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="zrun_logs_")
    cmd = build_agent_command(cfg, 0, log_dir, os.environ, available_cores())
    if cfg.dry_run:
        print("zrun: environment added:", " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()))
        print("zrun: command:", shlex.join(cmd.argv))
        if own_log_dir:
            os.rmdir(log_dir)
        return 0
    say(
        f"{cfg.nproc_per_node} rank(s) on this node, master {cfg.master_addr}:{cfg.master_port}; "
        f"{cmd.threads.message}"
    )
    if cmd.threads.warning:
        say(f"WARNING: {cmd.threads.warning}")

    become_subreaper()
    # Own session: a terminal Ctrl-C reaches zrun only, which then forwards it exactly once.
    proc = subprocess.Popen(
        cmd.argv,
        env={**os.environ, **cmd.env},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stderr is not None
    parser = FailureParser()
    relay = threading.Thread(target=_relay, args=(proc.stderr, parser), daemon=True)
    relay.start()
    mirror = Rank0Mirror(log_dir, cfg.run_id)
    mirror.start()
    stopper = _Stopper(proc)
    old = {s: signal.signal(s, stopper) for s in (signal.SIGINT, signal.SIGTERM)}
    ranks_killed = False
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > stopper.deadline:
                    say("the agent did not stop in time; killing it and every rank")
                    stopper.kill_all()
                since = parser.stopping_since
                if not ranks_killed and since is not None and time.monotonic() > since + SHUTDOWN_TIMEOUT_S:
                    # torch 2.13 waits a hard-coded 30 s for ranks to honour SIGTERM after a failure
                    # (--shutdown-timeout only covers signals to the agent); a rank stuck in a
                    # collective must not hold the job that long.
                    ranks_killed = True
                    stuck = kill_pids(descendants(proc.pid))
                    if stuck:
                        say(
                            f"rank process(es) {stuck} ignored SIGTERM for {SHUTDOWN_TIMEOUT_S} s; sent SIGKILL"
                        )
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    # Anything still alive (ranks of a killed agent, adopted by us as subreaper) must not outlive zrun.
    leftovers = kill_pids(sorted(stopper.pids | set(descendants(os.getpid()))))
    if leftovers:
        say(f"killed {len(leftovers)} leftover process(es): {leftovers}")
    reap_children()
    relay.join(timeout=5)
    mirror.stop()

    if stopper.signum is not None:
        say(f"stopped by {signal.Signals(stopper.signum).name}; all ranks were stopped")
        if own_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)  # the user stopped it: nothing to investigate
        return 128 + stopper.signum
    if rc == 0:
        if own_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    failure = pick_root_cause(parser.failures, lambda f: last_write(log_dir, cfg.run_id, f.local_rank))
    if failure is None:
        say(
            f"the agent exited with code {rc} without naming a failed rank (see its output above); "
            f"hint: per-rank logs are in {log_dir}"
        )
        return rc if rc > 0 else 1
    _report_failure(failure, cfg, log_dir, kept=not own_log_dir)
    return failure.zrun_exit_code()
