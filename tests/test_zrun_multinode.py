"""zrun across hosts, for real: separate hosts (network namespaces with their own sshd) over the ssh
backend, and mpirun on localhost. The training job's gloo traffic crosses the hosts' veth links."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from separate_hosts import Hosts, separate_hosts, why_no_separate_hosts
from test_zrun import zrun as _zrun

from launcher.args import config_from_args
from launcher.errors import LaunchError
from launcher.preflight import preflight_hosts

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "zrun_scripts"
NASTY = ["a b", "it's", 'say "hi"', "x; touch /tmp/zrun_pwned", "$(touch /tmp/zrun_pwned)", "`id`", ""]


def zrun(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _zrun(*args, timeout=180, env=env, cwd=cwd)


def _start_forever(
    hosts: Hosts, tmp_path: Path, port: int, **popen: object
) -> tuple[subprocess.Popen[str], dict[int, int]]:
    """zrun over both hosts running allreduce_forever.py; returns it and {rank: pid} once all run."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    argv = [
        "--hostfile",
        _hostfile(tmp_path, hosts),
        "--master_port",
        str(port),
        "--launcher_args",
        " ".join(hosts.ssh_args),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.zrun", *argv, str(SCRIPTS / "allreduce_forever.py"), str(pids_dir)],
        cwd=ROOT,
        text=True,
        **popen,  # type: ignore[call-overload]
    )
    try:
        files = _wait_for_files(pids_dir, "rank*.pid", 4, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, {int(f.stem[4:]): int(f.read_text()) for f in files}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Two hosts for the whole module: building them (keys, sshd) is the slow part."""
    reason = why_no_separate_hosts()
    if reason:
        print(f"separate hosts unavailable: {reason}")
        pytest.skip(reason)
    with separate_hosts(2, tmp_path_factory.mktemp("hosts")) as built:
        yield built


def _hostfile(tmp_path: Path, hosts: Hosts, slots: int = 2) -> str:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{a} slots={slots}\n" for a in hosts.addrs))
    return str(path)


def _assert_hosts_idle(hosts: Hosts) -> None:
    for i in range(len(hosts.addrs)):
        left = hosts.wait_idle(i, timeout=10)
        assert left == [], f"processes survived on host {i} ({hosts.addrs[i]}): {_describe(left)}"


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for_files(d: Path, pattern: str, n: int, proc: subprocess.Popen[str], timeout: float = 90) -> list[Path]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted(d.glob(pattern))
        if len(found) >= n:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"zrun exited early ({proc.returncode}): {proc.communicate()[0]}")
        time.sleep(0.1)
    raise AssertionError(f"only {sorted(d.glob(pattern))} after {timeout} s")


# ---------------------------------------------------------------- ssh backend, two hosts


def test_two_hosts_train_like_one_node(hosts: Hosts, tmp_path: Path) -> None:
    """2 nodes x 2 ranks over ssh: the same losses as 1 node x 4 ranks, bit for bit."""
    hf = _hostfile(tmp_path, hosts)
    t0 = time.time()
    logs = tmp_path / "logs"
    r = zrun(
        "--hostfile",
        hf,
        "--log_dir",
        str(logs),
        "--launcher_args",
        " ".join(hosts.ssh_args),
        str(SCRIPTS / "train_losses.py"),
        str(tmp_path / "two.json"),
    )
    wall = time.time() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"2 hosts x 2 ranks, stage-2 training over ssh: {wall:.1f} s wall")
    assert f"zrun: 2 node(s), world size 4, via ssh; master {hosts.addrs[0]}:29500" in r.stderr
    for addr in hosts.addrs:  # each node's zrun chose the interface on the hosts' subnet for gloo
        assert f"zrun[{addr}]: 2 rank(s) on this node (node" in r.stderr
    assert "gloo on eth0" in r.stderr  # the hosts' interface towards the master, not loopback
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):  # per-rank logs, one folder per node
        for local, rank in enumerate(ranks):
            (log,) = logs.glob(f"{node}/zrun-*/attempt_0/{local}/stdout.log")
            assert f"rank {rank} of 4" in log.read_text()
    one = zrun(
        "--nproc_per_node", "4", "--master_port", "29531", str(SCRIPTS / "train_losses.py"), str(tmp_path / "one.json")
    )
    assert one.returncode == 0, one.stderr
    two_nodes = json.loads((tmp_path / "two.json").read_text())
    one_node = json.loads((tmp_path / "one.json").read_text())
    assert two_nodes["world"] == one_node["world"] == 4
    assert two_nodes["losses"] == one_node["losses"]
    _assert_hosts_idle(hosts)


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="no pdsh (Debian: pdsh)")
def test_pdsh_backend_trains_across_hosts(hosts: Hosts, tmp_path: Path) -> None:
    """pdsh runs one command on every host; each node finds its rank from pdsh's %h in --world."""
    hf = _hostfile(tmp_path, hosts)
    env = {"PDSH_SSH_ARGS_APPEND": " ".join(hosts.ssh_args)}  # the user's own ssh options are kept
    r = zrun(
        "--hostfile",
        hf,
        "--launcher",
        "pdsh",
        "--master_port",
        "29538",
        str(SCRIPTS / "train_losses.py"),
        str(tmp_path / "pdsh.json"),
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for k, addr in enumerate(hosts.addrs):
        assert f"{addr}: zrun[{addr}]: 2 rank(s) on this node (node {k} of 2, world size 4" in r.stderr
    got = json.loads((tmp_path / "pdsh.json").read_text())
    assert got["world"] == 4 and len(got["losses"]) == 6 and got["losses"][-1] < got["losses"][0]
    _assert_hosts_idle(hosts)


def test_ranks_get_the_arguments_and_environment_exactly(hosts: Hosts, tmp_path: Path) -> None:
    """Script arguments and exported values full of quotes and `;` arrive verbatim; nothing runs."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / ".zrun_env").write_text("ZRUN_TEST_VALUE=$(touch /tmp/zrun_pwned); 'q' \"d\" `id`\n")
    hf = _hostfile(tmp_path, hosts, slots=1)
    r = zrun(
        "--hostfile",
        hf,
        "--launcher_args",
        " ".join(hosts.ssh_args),
        "--master_port",
        "29532",
        str(SCRIPTS / "report_env.py"),
        str(out),
        *NASTY,
        cwd=tmp_path,
        env={"NCCL_TEST_VALUE": "it's; rm -rf /tmp/nothing"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for rank, addr in enumerate(hosts.addrs):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["argv"] == NASTY and got["cwd"] == str(tmp_path)
        assert got["env"]["ZRUN_TEST_VALUE"] == "$(touch /tmp/zrun_pwned); 'q' \"d\" `id`"
        assert got["env"]["NCCL_TEST_VALUE"] == "it's; rm -rf /tmp/nothing"
        assert got["env"]["MASTER_ADDR"] == hosts.addrs[0] and got["env"]["WORLD_SIZE"] == "2"
        assert got["env"]["GLOO_SOCKET_IFNAME"]  # chosen per node: the interface towards the master
        assert (
            hosts.exec(rank, ["ip", "-o", "-4", "addr", "show", "dev", got["env"]["GLOO_SOCKET_IFNAME"]]).stdout.count(
                addr
            )
            == 1
        )
    assert not os.path.exists("/tmp/zrun_pwned")


def test_dry_run_prints_every_node_command(hosts: Hosts, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, hosts)
    r = zrun(
        "--hostfile",
        hf,
        "--ssh_port",
        "22",
        "--launcher_args",
        " ".join(hosts.ssh_args),
        "--dry_run",
        "train.py",
        "--x",
        "a b",
    )
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    for k, addr in enumerate(hosts.addrs):
        assert lines[k].startswith(f"zrun: node {k} ({addr}): ssh -o BatchMode=yes -o ConnectTimeout=10 -p 22 -F ")
        assert f"-- {addr} 'cd {ROOT} && exec env " in lines[k]
        assert f"--node_rank {k} --exit_with_stdin --world {hosts.addrs[0]}:0,1@{hosts.addrs[1]}:0,1" in lines[k]
        assert lines[k].endswith("train.py --x '\"'\"'a b'\"'\"''")


def test_a_rank_killed_on_host_2_stops_the_job_everywhere(hosts: Hosts, tmp_path: Path) -> None:
    proc, pids = _start_forever(hosts, tmp_path, 29533, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert pids[3] in hosts.pids(1) and pids[0] in hosts.pids(0)  # rank 3 really runs on host 2
        killed_at = time.time()
        os.kill(pids[3], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        stopped_in = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    print(out[-3000:])
    print(f"rank 3 SIGKILLed on host 2 -> zrun exited {proc.returncode} after {stopped_in:.1f} s")
    assert proc.returncode == 137, out
    assert f"zrun: [{hosts.addrs[1]} rank 3] (local rank 1) was killed by signal 9, first of any node" in out
    assert stopped_in < 20
    assert [p for p in pids.values() if _alive(p)] == []
    _assert_hosts_idle(hosts)


def test_sigterm_to_zrun_stops_every_rank_on_every_host(hosts: Hosts, tmp_path: Path) -> None:
    proc, pids = _start_forever(hosts, tmp_path, 29534, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "zrun: stopped by SIGTERM; every node was stopped" in out
    assert [p for p in pids.values() if _alive(p)] == []
    _assert_hosts_idle(hosts)


def test_killed_ssh_link_stops_the_remote_ranks(hosts: Hosts, tmp_path: Path) -> None:
    """SIGKILL to zrun itself: nothing can clean up but the nodes, which see their stdin end."""
    proc, pids = _start_forever(
        hosts, tmp_path, 29535, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    os.killpg(proc.pid, signal.SIGKILL)  # zrun and its ssh clients, as a lost login session would
    proc.wait()
    deadline = time.time() + 20
    while any(_alive(p) for p in pids.values()) and time.time() < deadline:
        time.sleep(0.1)
    assert [p for p in pids.values() if _alive(p)] == []
    _assert_hosts_idle(hosts)


# ---------------------------------------------------------------- preflight


def _cfg(hf: str, hosts: Hosts, port: int = 29536) -> object:
    return config_from_args(
        ["--hostfile", hf, "--master_port", str(port), "--launcher_args", " ".join(hosts.ssh_args), "t.py"]
    )


def test_preflight_names_the_host_and_the_cause(hosts: Hosts, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, hosts)
    cfg = _cfg(hf, hosts)
    preflight_hosts(cfg, str(ROOT), sys.executable)  # type: ignore[arg-type]  # all well: no error
    with pytest.raises(LaunchError) as e:
        preflight_hosts(cfg, "/no/such/zrun/dir", sys.executable)  # type: ignore[arg-type]
    for addr in hosts.addrs:
        assert f"[{addr}] the job's directory /no/such/zrun/dir does not exist there" in str(e.value)
    with pytest.raises(LaunchError, match=rf"\[{hosts.addrs[1]}\] python /no/python is missing there"):
        preflight_hosts(cfg, str(ROOT), "/no/python")  # type: ignore[arg-type]
    bare = shutil.which("python3", path="/usr/bin:/bin")  # a python without torch
    if bare:
        with pytest.raises(
            LaunchError, match=rf"\[{hosts.addrs[0]}\] the project is not importable there: cannot import torch"
        ):
            preflight_hosts(cfg, str(ROOT), bare)  # type: ignore[arg-type]
    # The master port taken on host 1 (node 0) by another program:
    listener = hosts.popen(
        0,
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.socket(); s.bind(('{hosts.addrs[0]}', 29536)); s.listen(); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
    try:
        with pytest.raises(
            LaunchError, match=rf"\[{hosts.addrs[0]}\] --master_port 29536 is already in use on the master"
        ):
            preflight_hosts(cfg, str(ROOT), sys.executable)  # type: ignore[arg-type]
    finally:
        listener.kill()
        listener.wait()


def test_unreachable_host_fails_before_any_rank_starts(hosts: Hosts, tmp_path: Path) -> None:
    dead = str(hosts.subnet.network_address + 200)  # on the hosts' subnet, nobody answers
    hf = tmp_path / "hostfile"
    hf.write_text(f"{hosts.addrs[0]} slots=1\n{dead} slots=1\n")
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    t0 = time.time()
    r = zrun(
        "--hostfile",
        str(hf),
        "--launcher_args",
        " ".join(hosts.ssh_args),
        str(SCRIPTS / "sleep_pids.py"),
        str(pids_dir),
    )
    print(r.stderr, f"{time.time() - t0:.1f} s")
    assert r.returncode == 1
    assert "zrun: error: preflight found problems, no rank was started:" in r.stderr
    assert f"[{dead}] ssh failed: " in r.stderr and "hint:" in r.stderr
    assert hosts.addrs[0] not in r.stderr.split("no rank was started:")[1]  # the good host is not blamed
    assert list(pids_dir.iterdir()) == []
    _assert_hosts_idle(hosts)


# ---------------------------------------------------------------- mpirun on localhost


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (Debian: openmpi-bin)")
def test_openmpi_backend_trains_on_localhost(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("localhost slots=2\n")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    r = zrun(
        "--hostfile",
        str(hf),
        "--launcher",
        "openmpi",
        "--master_port",
        "29537",
        str(SCRIPTS / "train_losses.py"),
        str(tmp_path / "mpi.json"),
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "zrun: 1 node(s), world size 2, via openmpi" in r.stderr
    assert "rank 1 of 2" in r.stdout + r.stderr
    got = json.loads((tmp_path / "mpi.json").read_text())
    assert got["world"] == 2 and len(got["losses"]) == 6 and got["losses"][-1] < got["losses"][0]
