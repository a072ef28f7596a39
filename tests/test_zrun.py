"""zrun: argument parsing, the agent command, thread choice, and real multi-process jobs on CPU."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.args import config_from_args
from launcher.command import CONSOLE_ENV, build_agent_command
from launcher.config import Host
from launcher.errors import LaunchError
from launcher.report import FailureParser, RankFailure, pick_root_cause
from launcher.threads import plan_threads

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "zrun_scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def zrun(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`python -m launcher.zrun ARGS` from `cwd`; the project stays importable from any directory."""
    return subprocess.run(
        [sys.executable, "-m", "launcher.zrun", *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


# ---------------------------------------------------------------- parsing


def test_synonyms_and_defaults() -> None:
    a = config_from_args(["--num_gpus", "3", "train.py"])
    b = config_from_args(["--nproc_per_node=3", "train.py"])
    assert a.nproc_per_node == b.nproc_per_node == 3
    assert a.master_addr == "127.0.0.1" and a.master_port is None
    assert not a.append_local_rank and not a.module and not a.no_python


def test_script_args_untouched_even_if_they_look_like_zrun_flags() -> None:
    tail = ["--master_port", "1", "--num_gpus", "7", "-h", "--local_rank=3", "--dry_run", "x y"]
    cfg = config_from_args(["--nproc_per_node", "2", "--append_local_rank", "train.py", *tail])
    assert cfg.script == "train.py" and cfg.script_args == tuple(tail)
    assert cfg.nproc_per_node == 2 and cfg.master_port is None and not cfg.dry_run and cfg.append_local_rank


def test_unknown_zrun_flag_before_script_errors_clearly() -> None:
    r = zrun("--nproc_per_nod", "2", "train.py")  # abbreviations are refused too
    assert r.returncode == 2
    assert "unrecognized arguments: --nproc_per_nod" in r.stderr and "hint" in r.stderr


def test_single_localhost_hostfile_and_multi_node_flags_are_parsed(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("localhost slots=4\n")
    cfg = config_from_args(
        [
            "--hostfile",
            str(hf),
            "--include",
            "localhost:1,3",
            "--launcher",
            "ssh",
            "--launcher_args=-q",
            "--ssh_port",
            "2222",
            "--node_rank",
            "0",
            "train.py",
        ]
    )
    assert cfg.hosts == (Host("localhost", (1, 3)),)
    # --node_rank 0: this node only (manual mode), whatever --launcher says.
    assert (cfg.launcher, cfg.launcher_args, cfg.ssh_port, cfg.node_rank) == ("local", "-q", 2222, 0)
    hf.write_text("localhost slots=2\nlocalhost slots=2\n")
    with pytest.raises(LaunchError, match="listed twice"):
        config_from_args(["--hostfile", str(hf), "train.py"])


# ---------------------------------------------------------------- agent command and threads


def test_build_agent_command() -> None:
    cfg = config_from_args(
        [
            "--nproc_per_node",
            "2",
            "--master_port",
            "1234",
            "--module",
            "--append_local_rank",
            "pkg.train",
            "--lr",
            "0.1",
        ]
    )
    argv, env, threads = build_agent_command(cfg, 0, "/logs", {}, cores=8, python="py")
    assert argv[:3] == ["py", "-m", "launcher.agent"]
    for opt in [
        "--nnodes=1",
        "--nproc-per-node=2",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        "--master-port=1234",
        "--max-restarts=0",
        "--log-dir=/logs",
        "--redirects=3",
        "--tee=1:3",  # node 0's local rank 0 is mirrored raw by zrun itself (launcher/mirror.py)
        "--module",
    ]:
        assert opt in argv
    assert any(a.startswith("--monitor-interval=") and float(a.split("=")[1]) <= 0.5 for a in argv)
    assert argv[-5:] == ["--", "pkg.train", "--lr", "0.1", "--local_rank=${local_rank}"]
    assert env["OMP_NUM_THREADS"] == "4" and threads.threads == 4 and threads.warning is None
    plain = config_from_args(["--master_port", "1", "t.py", "a"])
    argv2, env2, _ = build_agent_command(plain, 0, "/l", {"OMP_NUM_THREADS": "3"}, cores=8, python="py")
    assert argv2[-3:] == ["--", "t.py", "a"] and not any("local_rank" in a for a in argv2)
    assert "OMP_NUM_THREADS" not in env2  # the user's choice is inherited, not overridden


class _Console:
    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_the_ranks_are_told_whether_zruns_console_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank's stderr is a log file that zrun mirrors (launcher/mirror.py): only zrun knows what the console is.
    cfg = config_from_args(["--master_port", "1", "t.py"])
    for terminal, told in ((False, "0"), (True, "1")):
        monkeypatch.setattr(sys, "stderr", _Console(terminal))
        assert build_agent_command(cfg, 0, "/l", {}, cores=2, python="py").env[CONSOLE_ENV] == told
    assert build_agent_command(cfg, 0, "/l", {CONSOLE_ENV: "0"}, cores=2, python="py").env[CONSOLE_ENV] == "0"


def test_thread_choice_and_oversubscription_warning() -> None:
    p = plan_threads(2, 2, {})
    assert (p.threads, p.from_user, p.warning) == (1, False, None) and "2 cores // 2" in p.message
    assert plan_threads(3, 2, {}).threads == 1  # never 0
    assert "oversubscribed" in (plan_threads(3, 2, {}).warning or "")
    user = plan_threads(2, 2, {"OMP_NUM_THREADS": "4"})
    assert user.from_user and user.threads == 4 and "8 threads on 2 cores" in (user.warning or "")


def test_failure_summary_parsing_and_root_cause() -> None:
    import json

    from launcher.agent import FAILURES_TAG

    p = FailureParser()
    records = [
        {"rank": 0, "local_rank": 0, "exitcode": 1, "host": "localhost", "time": "2026-11-21_09:13:55", "root": False},
        {"rank": 1, "local_rank": 1, "exitcode": 7, "host": "localhost", "time": "2026-11-21_09:13:55", "root": True},
    ]
    # A rank printing the agent's line is echoed with its prefix: never taken for the agent's report.
    assert not p.feed("[rank0]:" + FAILURES_TAG + json.dumps(records[:1]))
    assert p.failures == []
    assert p.feed(FAILURES_TAG + json.dumps(records))  # the agent's report: consumed, not echoed
    assert not p.feed(FAILURES_TAG + "{not json")  # not a report after all: shown as it is
    assert [(f.rank, f.exitcode, f.agent_root) for f in p.failures] == [(0, 1, False), (1, 7, True)]
    # Same second: the rank whose log stopped changing first is the cause, whatever the agent said.
    root = pick_root_cause(p.failures, lambda f: {0: 5.0, 1: 9.0}[f.rank])
    assert root is not None and root.rank == 0
    killed = RankFailure(2, 0, -15, "h", "2026-11-21_09:13:54")
    assert pick_root_cause([killed, *p.failures], lambda f: 0.0).exitcode != -15  # victims are not causes
    assert RankFailure(0, 0, -9, "h").zrun_exit_code() == 137


# ---------------------------------------------------------------- real jobs


def test_two_rank_allreduce_job(tmp_path: Path) -> None:
    r = zrun(
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "--log_dir",
        str(tmp_path),
        str(SCRIPTS / "allreduce_ok.py"),
        "--lr",
        "0.1",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    for rank in (0, 1):
        assert f"ALLREDUCE_OK rank={rank} world=2 local_rank={rank}" in out
    assert "argv=['--lr', '0.1']" in out  # no --local_rank by default
    assert "zrun: 2 rank(s)" in r.stderr and "OMP_NUM_THREADS=" in r.stderr
    assert list(tmp_path.glob("zrun-*/attempt_0/1/stdout.log"))  # per-rank log files kept


def test_append_local_rank_flag() -> None:
    r = zrun(
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "--append_local_rank",
        str(SCRIPTS / "print_argv.py"),
        "--x",
    )
    assert r.returncode == 0, r.stderr
    assert "argv=['--x', '--local_rank=0']" in r.stdout and "argv=['--x', '--local_rank=1']" in r.stdout


@pytest.mark.parametrize("rank0_ignores_sigterm", [False, True])
def test_failing_rank_is_reported_quickly(tmp_path: Path, rank0_ignores_sigterm: bool) -> None:
    stamp = tmp_path / "failed_at"
    env = {"ZRUN_TEST_FAIL_STAMP": str(stamp)}
    logs: list[str] = []
    if rank0_ignores_sigterm:
        env["ZRUN_TEST_RANK0_STUCK"] = "1"  # torch alone would wait 30 s before SIGKILL
        logs = ["--log_dir", str(tmp_path / "logs")]  # the other case covers zrun's temporary log dir
    t0 = time.time()
    r = zrun(
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *logs,
        str(SCRIPTS / "fail_rank1.py"),
        env=env,
    )
    end = time.time()
    assert r.returncode == 1, r.stderr
    assert "[localhost rank 1] (local rank 1) exited with code 1" in r.stderr
    report = r.stderr[r.stderr.index("[localhost rank 1]") :]
    assert "zrun:   | [rank1]: RuntimeError: boom from rank 1" in report  # the tail, from the rank's log
    failure_to_exit = end - float(stamp.read_text())
    print(f"rank failure -> zrun exit: {failure_to_exit:.2f}s (whole run {end - t0:.2f}s)")
    assert failure_to_exit < (15 if rank0_ignores_sigterm else 10)
    assert ("ignored SIGTERM" in r.stderr) == rank0_ignores_sigterm
    kept = re.search(r"per-rank logs are in (\S+) \(a temporary directory, kept\)", r.stderr)
    assert bool(kept) != rank0_ignores_sigterm  # zrun's own temp dir is kept for a failure, and named
    if kept:
        shutil.rmtree(kept.group(1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks /proc")
def test_sigterm_stops_every_rank(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.zrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "sleep_pids.py"),
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 30
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out
    time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == []


def test_tee_spec_leaves_out_the_mirrored_rank() -> None:
    from launcher.mirror import tee_spec

    assert tee_spec(4, 0) == "1:3,2:3,3:3"
    assert tee_spec(1, 0) == "0"  # nothing to tee: the only rank is mirrored
    assert tee_spec(2, None) == "3"  # other nodes tee every rank


def test_rank0_output_reaches_the_console_raw_and_other_ranks_prefixed() -> None:
    # torchrun's tee would print each "\r" redraw as its own prefixed line; zrun mirrors rank 0's
    # bytes unchanged, so a progress bar redraws in place.
    r = subprocess.run(  # bytes, not text: universal newlines would turn "\r" into "\n"
        [
            sys.executable,
            "-m",
            "launcher.zrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "progress_bar.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert b"\rBAR 0/3\rBAR 1/3\rBAR 2/3\n" in r.stderr
    assert b"DONE rank=0" in r.stdout and b"[rank0]:DONE" not in r.stdout
    assert b"[rank1]:DONE rank=1" in r.stdout


def test_stage3_training_exits_cleanly() -> None:
    # DeepSpeed's stage 3 has been seen to abort at exit on CPU ("terminate called without an
    # active exception"); ours must exit 0 and print nothing of the kind.
    result = zrun(
        "--nproc_per_node", "2", "--master_port", str(free_port()), "tests/zrun_scripts/train_stage3.py", timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rank 0 trained 3 steps" in output, output
    assert "terminate called" not in output and "Traceback" not in output, output
