"""Run one node's agent: start it, relay its output, stop it on signals, report the failed rank."""

from __future__ import annotations

import dataclasses
import json
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

from launcher.agent import PARENT_ENV, TEMP_LOG_DIR_ENV
from launcher.command import SHUTDOWN_TIMEOUT_S, build_agent_command
from launcher.config import LaunchConfig
from launcher.errors import LaunchError
from launcher.mirror import Rank0Mirror
from launcher.netif import interface_towards
from launcher.ports import DEFAULT_PORT, free_port, port_is_free
from launcher.procs import become_subreaper, descendants, kill_pids, reap_children
from launcher.report import FailureParser, RankFailure, last_write, pick_root_cause, rank_log_files, tail
from launcher.threads import available_cores

TAIL_LINES = 20
# A node started by a controlling zrun ends its stderr with this line when a rank failed, so the
# controller can pick the first failure across nodes (JSON: rank, local_rank, code, t, tail).
NODE_FAILURE_TAG = "ZRUN_NODE_FAILURE "
_prefix = "zrun"


def say(msg: str) -> None:
    print(f"{_prefix}: {msg}", file=sys.stderr, flush=True)


def resolve_port(cfg: LaunchConfig) -> LaunchConfig:
    multi = len(cfg.hosts) > 1
    if cfg.master_port is not None:
        if not cfg.dry_run and cfg.node_rank == 0 and not port_is_free(cfg.master_port):
            raise LaunchError(
                f"[{cfg.node.name}] --master_port {cfg.master_port} is already in use; "
                f"hint: pick another port" + ("" if multi else ", or omit --master_port to get a free one")
            )
        return cfg
    port = DEFAULT_PORT
    # Only a lone node may move to a free port: other nodes could not know which one it took.
    if not multi and not cfg.dry_run and not port_is_free(port):
        port = free_port()
        say(f"port {DEFAULT_PORT} is busy, using free port {port} (pass --master_port to choose)")
    return dataclasses.replace(cfg, master_port=port)


def _relay(stream: IO[bytes], parser: FailureParser, stopper: _Stopper) -> None:
    # The agent's stderr carries the ranks' tee'd stderr, its log lines and its failure report:
    # echo every line at once, except the report (zrun's summary replaces it) and, once zrun was
    # told to stop, the agent's own shutdown chatter (zrun says it in one line). Ranks' lines
    # (`[rankN]:`) always pass: a script may say what it does on SIGTERM.
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if parser.feed(line.rstrip("\n")):
            continue
        if stopper.signum is not None and not line.startswith("[rank"):
            continue
        sys.stderr.write(line)
        sys.stderr.flush()


def _stop_at_end_of_stdin(stopper: _Stopper) -> None:
    """The controlling zrun holds our stdin open; its end means "stop" (or the ssh link is gone)."""

    def watch() -> None:
        # The raw descriptor, not sys.stdin: a daemon thread blocked inside the buffered reader
        # holds its lock, and the interpreter aborts at exit when it cannot take it.
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        if stopper.signum is None:
            say("the controlling zrun stopped this node (its stdin closed); stopping every rank here")
            stopper(signal.SIGTERM, None)

    threading.Thread(target=watch, daemon=True).start()


class _Stopper:
    """SIGINT/SIGTERM/SIGHUP: SIGTERM the agent's process group once; a second signal kills at once.

    Always SIGTERM, whatever zrun got: the agent passes its signal on to the ranks, and a SIGINT
    would print a KeyboardInterrupt traceback in every rank; SIGTERM's default action is silent.
    """

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
            self._send(signal.SIGTERM)
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
    failure = dataclasses.replace(failure, host=cfg.node.name) if len(cfg.hosts) > 1 else failure
    say(f"{failure.describe()}; the agent stopped the other ranks")
    if not failure.agent_root:
        say("(the agent's own pick differs: its failure times are whole seconds, so the logs decided)")
    shown: list[str] = []
    for path in rank_log_files(log_dir, cfg.run_id, failure.local_rank):
        lines = tail(path, TAIL_LINES)
        if lines:
            shown.append(f"last {len(lines)} lines of rank {failure.rank}'s {os.path.basename(path)[:-4]}:")
            shown.extend(f"  | {line}" for line in lines)
    where = f"per-rank logs are in {log_dir}" + ("" if kept else " (a temporary directory, kept)")
    if cfg.exit_with_stdin:
        # The controlling zrun prints the report once, for the failure that came first on any node.
        t = last_write(log_dir, cfg.run_id, failure.local_rank)
        record = {**dataclasses.asdict(failure), "t": t, "tail": [*shown, f"hint: {where} on {cfg.node.name}"]}
        print(NODE_FAILURE_TAG + json.dumps(record), file=sys.stderr, flush=True)
        return
    for line in shown:
        print(f"{_prefix}: {line}", file=sys.stderr)
    say(f"hint: {where}")


def _gloo_interface(cfg: LaunchConfig, env: dict[str, str]) -> None:
    if len(cfg.hosts) == 1 or "GLOO_SOCKET_IFNAME" in os.environ or "GLOO_SOCKET_IFNAME" in env:
        return
    assert cfg.master_port is not None
    name = interface_towards(cfg.master_addr, cfg.master_port)
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name


def run(cfg: LaunchConfig) -> int:
    """Run this node's agent (node cfg.node_rank of cfg.hosts) until its ranks end."""
    global _prefix
    multi = len(cfg.hosts) > 1
    if multi:
        _prefix = f"zrun[{cfg.node.name}]"
    cfg = resolve_port(cfg)
    node_rank = cfg.node_rank or 0
    own_log_dir = cfg.log_dir is None
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="zrun_logs_")
    if multi and cfg.log_dir:
        log_dir = os.path.join(cfg.log_dir, f"node{node_rank}")  # a shared filesystem: one folder per node
    cmd = build_agent_command(cfg, node_rank, log_dir, os.environ, available_cores())
    _gloo_interface(cfg, cmd.env)
    if cfg.dry_run:
        print("zrun: environment added:", " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()))
        print("zrun: command:", shlex.join(cmd.argv))
        if own_log_dir:
            os.rmdir(log_dir)
        return 0
    world = f"node {node_rank} of {len(cfg.hosts)}, world size {cfg.world_size}, " if multi else ""
    gloo = f"; gloo on {cmd.env['GLOO_SOCKET_IFNAME']}" if multi and "GLOO_SOCKET_IFNAME" in cmd.env else ""
    say(
        f"{cfg.nproc_per_node} rank(s) on this node ({world}master {cfg.master_addr}:{cfg.master_port}); "
        f"{cmd.threads.message}{gloo}"
    )
    if cmd.threads.warning:
        say(f"WARNING: {cmd.threads.warning}")

    become_subreaper()
    # Own session: a terminal Ctrl-C reaches zrun only, which then stops the agent exactly once.
    # This thread starts the agent and waits for it below: the agent's parent-death signal
    # (launcher/agent.py) is tied to this thread, so it fires only when zrun itself dies.
    proc = subprocess.Popen(
        cmd.argv,
        env={
            **os.environ,
            **cmd.env,
            PARENT_ENV: str(os.getpid()),
            **({TEMP_LOG_DIR_ENV: log_dir} if own_log_dir else {}),
        },
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stderr is not None
    parser = FailureParser()
    stopper = _Stopper(proc)
    relay = threading.Thread(target=_relay, args=(proc.stderr, parser, stopper), daemon=True)
    relay.start()
    # Global rank 0's output is mirrored raw (progress bars); it lives on node 0.
    mirror = Rank0Mirror(log_dir, cfg.run_id) if node_rank == 0 else None
    if mirror:
        mirror.start()
    # A node started over a terminal (ssh -t, a pdsh/mpirun variant) gets SIGHUP when the link dies.
    stop_on = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if multi else (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, stopper) for s in stop_on}
    if cfg.exit_with_stdin:
        _stop_at_end_of_stdin(stopper)
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
                        say(f"rank process(es) {stuck} ignored SIGTERM for {SHUTDOWN_TIMEOUT_S} s; sent SIGKILL")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    # Anything still alive (ranks of a killed agent, adopted by us as subreaper) must not outlive zrun.
    leftovers = kill_pids(sorted(stopper.pids | set(descendants(os.getpid()))))
    if leftovers:
        say(f"killed {len(leftovers)} leftover process(es): {leftovers}")
    reap_children()
    relay.join(timeout=5)
    if mirror:
        mirror.stop()

    if stopper.signum is not None:
        say(f"stopped by {signal.Signals(stopper.signum).name}; {cfg.nproc_per_node} rank(s) stopped")
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
