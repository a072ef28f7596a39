"""zrun's world: hostfile, --include/--exclude, node modes, SLURM node lists, the node commands each
backend builds, the exported environment, and shell quoting (run through a real shell)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.args import config_from_args
from launcher.backends import node_zrun_argv, plan_openmpi, plan_pdsh, plan_slurm, plan_ssh, remote_shell_command
from launcher.config import Host
from launcher.errors import LaunchError
from launcher.hostfile import format_world, parse_hostfile, parse_world, select_slots
from launcher.node_env import exported_env, read_env_file
from launcher.slurm import expand_nodelist, slurm_hosts

# ---------------------------------------------------------------- hostfile and include/exclude

HOSTFILE_CASES = [
    ("a slots=2\nb slots=4\n", {"a": 2, "b": 4}),
    ("# cluster\n\na slots=1   # first\n  b   slots=8  \n", {"a": 1, "b": 8}),
    ("worker-1.example.com slots=2\n10.0.0.7 slots=1\n", {"worker-1.example.com": 2, "10.0.0.7": 1}),
]


@pytest.mark.parametrize(("text", "want"), HOSTFILE_CASES)
def test_hostfile_parses(text: str, want: dict[str, int]) -> None:
    assert dict(parse_hostfile(text, "hf")) == want


HOSTFILE_ERRORS = [
    ("", "hf: the hostfile lists no hosts"),
    ("# only a comment\n\n", "hf: the hostfile lists no hosts"),
    ("a slots=2\na slots=2\n", "hf:2: host 'a' is listed twice"),
    ("a slots=2\nb\n", "hf:2: bad hostfile line 'b'"),
    ("a slots=x\n", "hf:1: bad hostfile line"),
    ("a slots=-1\n", "hf:1: bad hostfile line"),
    ("a slots=0\n", "hf:1: host 'a' has slots=0"),
    ("a slots=2 extra\n", "hf:1: bad hostfile line"),
    ("a slots=2\n-oProxyCommand=evil slots=1\n", "hf:2: '-oProxyCommand=evil' is not a host name"),
    ("a;reboot slots=1\n", "hf:1: 'a;reboot' is not a host name"),
    ("a'b slots=1\n", 'hf:1: "a\'b" is not a host name'),
    ("$(touch) slots=1\n", "hf:1: '\\$\\(touch\\)' is not a host name"),
]


@pytest.mark.parametrize(("text", "error"), HOSTFILE_ERRORS)
def test_hostfile_errors_name_file_line_and_problem(text: str, error: str) -> None:
    with pytest.raises(LaunchError, match=error) as e:
        parse_hostfile(text, "hf")
    assert "hint:" in str(e.value)


HOSTS = parse_hostfile("a slots=4\nb slots=4\nc slots=2\n", "hf")
SELECT_CASES = [
    (None, None, {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}),
    ("b", None, {"b": [0, 1, 2, 3]}),
    ("c@a:0,2", None, {"a": [0, 2], "c": [0, 1]}),  # hostfile order, not --include order
    (None, "b", {"a": [0, 1, 2, 3], "c": [0, 1]}),
    (None, "a:1,3@c", {"a": [0, 2], "b": [0, 1, 2, 3]}),
    (None, "c:0,1", {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}),  # all slots excluded: the host goes
]


@pytest.mark.parametrize(("include", "exclude", "want"), SELECT_CASES)
def test_include_exclude(include: str | None, exclude: str | None, want: dict[str, list[int]]) -> None:
    assert dict(select_slots(HOSTS, include, exclude)) == want


SELECT_ERRORS = [
    ("a", "b", "mutually exclusive"),
    ("z", None, "--include names host 'z', which is not in the hostfile"),
    ("a:4", None, r"host 'a' has no slot\(s\) \[4\] \(slots=4\)"),
    ("a:x", None, "slot ids must be integers"),
    ("@a", None, "empty host name"),
    (None, "z", "--exclude names host 'z'"),
    (None, "a@b@c", "left no slots"),
]


@pytest.mark.parametrize(("include", "exclude", "error"), SELECT_ERRORS)
def test_include_exclude_errors(include: str | None, exclude: str | None, error: str) -> None:
    with pytest.raises(LaunchError, match=error):
        select_slots(HOSTS, include, exclude)


def test_world_spec_round_trips() -> None:
    hosts = (Host("n1", (0, 1)), Host("10.0.0.2", (1, 3)))
    assert format_world(hosts) == "n1:0,1@10.0.0.2:1,3"
    assert parse_world(format_world(hosts)) == hosts
    with pytest.raises(LaunchError, match="has no slots"):
        parse_world("n1@n2:0")


# ---------------------------------------------------------------- node modes


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_multi_node_hostfile_makes_a_controller(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "# two nodes\nworker-1 slots=2\n\nworker-2 slots=4\n")
    cfg = config_from_args(["--hostfile", hf, "train.py", "--x"])
    assert cfg.is_controller and cfg.launcher == "ssh" and cfg.world_size == 6
    assert cfg.hosts == (Host("worker-1", (0, 1)), Host("worker-2", (0, 1, 2, 3)))
    assert cfg.master_addr == "worker-1"  # DeepSpeed: the first host
    assert cfg.master_port is None and cfg.script_args == ("--x",)
    cut = config_from_args(["--hostfile", hf, "--num_nodes", "1", "--num_gpus", "1", "--launcher", "pdsh", "t.py"])
    assert cut.hosts == (Host("worker-1", (0,)),) and cut.launcher == "pdsh" and cut.is_controller
    addr = config_from_args(["--hostfile", hf, "--rdzv_endpoint", "10.9.9.9:1234", "--rdzv_id", "job7", "t.py"])
    assert (addr.master_addr, addr.master_port, addr.run_id) == ("10.9.9.9", 1234, "job7")


def test_manual_mode_runs_one_node(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "n1 slots=2\nn2 slots=3\n")
    cfg = config_from_args(["--hostfile", hf, "--node_rank", "1", "t.py"])
    assert not cfg.is_controller and cfg.node_rank == 1 and cfg.nproc_per_node == 3 and cfg.master_addr == "n1"
    torchrun = config_from_args(
        ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2", "--rdzv_endpoint", "h0:29400", "t.py"]
    )
    assert torchrun.node_rank == 1 and len(torchrun.hosts) == 2 and torchrun.world_size == 4
    assert (torchrun.master_addr, torchrun.master_port) == ("h0", 29400)


def test_node_rank_from_name_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    world = ["--world", "n1:0@n2:0,1", "--master_addr", "n1", "--master_port", "5"]
    assert config_from_args([*world, "--node_name", "n2", "t.py"]).node_rank == 1
    monkeypatch.setenv("SLURM_NODEID", "0")
    cfg = config_from_args([*world, "--node_rank_from", "SLURM_NODEID", "t.py"])
    assert cfg.node_rank == 0 and cfg.nproc_per_node == 1 and cfg.master_port == 5


NODE_ERRORS = [
    (["--node_name", "n3"], "--node_name 'n3' is not one of the world's hosts"),
    (["--node_rank_from", "NO_SUCH_VAR_ZRUN"], r"\$NO_SUCH_VAR_ZRUN is 'unset', not a node number"),
    (["--node_rank", "2"], "node rank 2 is outside the world of 2 node"),
]


@pytest.mark.parametrize(("extra", "error"), NODE_ERRORS)
def test_node_mode_errors(extra: list[str], error: str) -> None:
    with pytest.raises(LaunchError, match=error):
        config_from_args(["--world", "n1:0@n2:0", "--master_addr", "n1", *extra, "t.py"])


MODE_ERRORS = [
    ("localhost slots=1\nn2 slots=1\n", [], "the first host 'localhost' .* loopback name"),
    (
        "n1 slots=1\nn2 slots=1\n",
        ["--launcher", "local"],
        "--launcher local runs one node of 2; hint: say which with --node_rank",
    ),
    ("n1 slots=1\nn2 slots=1\n", ["--launcher", "mvapich"], "--launcher mvapich is not supported"),
    ("n1 slots=1\nn2 slots=1\n", ["--num_nodes", "3"], "--num_nodes 3: the hostfile .* has only 2 host"),
    ("n1 slots=1\n", ["--rdzv_endpoint", "nohost"], "expected HOST:PORT"),
    ("n1 slots=1\n", ["--launcher", "slurm"], "takes its nodes from the SLURM allocation, not from --hostfile"),
]


@pytest.mark.parametrize(("text", "extra", "error"), MODE_ERRORS)
def test_launch_mode_errors(tmp_path: Path, text: str, extra: list[str], error: str) -> None:
    with pytest.raises(LaunchError, match=error):
        config_from_args(["--hostfile", _hostfile(tmp_path, text), *extra, "t.py"])


def test_manual_mode_without_hostfile_needs_the_master() -> None:
    with pytest.raises(LaunchError, match="node 1 of 2: the master's address is unknown; hint: pass --master_addr"):
        config_from_args(["--nnodes", "2", "--node_rank", "1", "t.py"])


# ---------------------------------------------------------------- SLURM


NODELISTS = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[1-2]-b[8-9]", ["a1-b8", "a1-b9", "a2-b8", "a2-b9"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
]


@pytest.mark.parametrize(("nodelist", "want"), NODELISTS)
def test_slurm_nodelist_expansion(nodelist: str, want: list[str]) -> None:
    assert expand_nodelist(nodelist) == want


def test_slurm_hosts_and_errors() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[1-3]"}
    assert slurm_hosts(env, 2, None) == tuple(Host(f"gpu{i}", (0, 1)) for i in (1, 2, 3))
    assert [h.name for h in slurm_hosts(env, 1, 2)] == ["gpu1", "gpu2"]
    with pytest.raises(LaunchError, match="not inside a SLURM allocation"):
        slurm_hosts({}, 1, None)
    with pytest.raises(LaunchError, match="the allocation has 3 node"):
        slurm_hosts(env, 1, 4)
    with pytest.raises(LaunchError, match="bad range 'x'"):
        expand_nodelist("n[x]")


def test_slurm_backend_argv_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    cfg = config_from_args(
        [
            "--launcher",
            "slurm",
            "--nproc_per_node",
            "4",
            "--master_port",
            "29555",
            "--launcher_args",
            "--exclusive -A proj",
            "t.py",
            "--lr",
            "1",
        ]
    )
    assert cfg.is_controller and cfg.master_addr == "gpu07" and cfg.world_size == 8
    (plan,) = plan_slurm(cfg, {"NCCL_DEBUG": "INFO"}, "/job dir", "/venv/bin/python")
    argv = plan.argv
    assert argv[: argv.index("/venv/bin/python")] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--nodelist=gpu07,gpu08",
        "--chdir=/job dir",
        "--export=ALL",
        "--exclusive",
        "-A",
        "proj",
    ]
    node = argv[argv.index("/venv/bin/python") :]
    assert node[:6] == ["/venv/bin/python", "-u", "-m", "launcher.zrun", "--node_rank_from", "SLURM_NODEID"]
    assert "--world" in node and node[node.index("--world") + 1] == "gpu07:0,1,2,3@gpu08:0,1,2,3"
    assert node[-3:] == ["t.py", "--lr", "1"] and "--master_addr" in node and "29555" in node
    assert plan.env == {"NCCL_DEBUG": "INFO"}  # srun --export=ALL carries the environment we give it
    # What a node then makes of it, with SLURM's variables set for its task:
    monkeypatch.setenv("SLURM_NODEID", "1")
    mine = config_from_args(node[4:])
    assert mine.node_rank == 1 and mine.node.name == "gpu08" and mine.master_addr == "gpu07"


def test_openmpi_and_pdsh_argv(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "n1 slots=2\nn2 slots=2\n")
    cfg = config_from_args(
        ["--hostfile", hf, "--launcher", "openmpi", "--master_port", "7", "--ssh_port", "2200", "t.py", "100%"]
    )
    (mpi,) = plan_openmpi(cfg, {"OMP_NUM_THREADS": "2", "NCCL_X": "a b"}, "/w", "py")
    a = mpi.argv
    assert a[:7] == ["mpirun", "-n", "2", "--map-by", "ppr:1:node", "--bind-to", "none"]
    assert a[7:11] == ["--host", "n1:1,n2:1", "--wdir", "/w"]
    assert a[11:15] == ["-x", "OMP_NUM_THREADS", "-x", "NCCL_X"] and mpi.env["NCCL_X"] == "a b"
    assert a[15:18] == ["--mca", "plm_rsh_args", "-p 2200"]
    assert a[18:24] == ["py", "-u", "-m", "launcher.zrun", "--node_rank_from", "OMPI_COMM_WORLD_RANK"]
    pdsh_cfg = dataclasses.replace(cfg, launcher="pdsh")
    (pdsh,) = plan_pdsh(pdsh_cfg, {"A": "50%"}, "/w", "py", {"PDSH_SSH_ARGS_APPEND": "-F /my/cfg"})
    assert pdsh.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "n1,n2"] and pdsh.env["PDSH_RCMD_TYPE"] == "ssh"
    assert pdsh.env["PDSH_SSH_ARGS_APPEND"] == "-F /my/cfg -o BatchMode=yes -o ConnectTimeout=10 -p 2200"
    remote = pdsh.argv[-1]
    # pdsh substitutes %h with each host's name and %% with %: do that, then run it through a shell.
    for host in ("n1", "n2"):
        words = shlex.split(remote.replace("%h", host).replace("%%", "%"))
        assert words[words.index("--node_name") + 1] == host
        assert words[-2:] == ["t.py", "100%"] and "A=50%" in words


# ---------------------------------------------------------------- ssh commands and quoting


NASTY = ["a b", "it's", 'say "hi"', "x; touch /tmp/zrun_pwned", "$(touch /tmp/zrun_pwned)", "`id`", "\\", "", "%n"]


def test_ssh_backend_command_survives_a_real_shell(tmp_path: Path) -> None:
    """Every word reaches the node exactly: the built line is run by sh, as sshd would run it."""
    hf = _hostfile(tmp_path, "10.0.0.1 slots=1\n10.0.0.2 slots=1\n")
    cfg = config_from_args(
        [
            "--hostfile",
            hf,
            "--master_port",
            "9",
            "--ssh_port",
            "2222",
            "--launcher_args",
            "-i /k -o X=y",
            "t.py",
            *NASTY,
        ]
    )
    d = tmp_path / "dir with 'quote; and space"
    d.mkdir()
    plans = plan_ssh(cfg, {"NCCL_A": "v; touch /tmp/zrun_pwned", "PYTHONX": "it's $(id)"}, str(d), "py")
    assert [p.label for p in plans] == ["node 0 (10.0.0.1)", "node 1 (10.0.0.2)"] and all(p.stdin_stop for p in plans)
    ssh = plans[1].argv
    assert ssh[:9] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", "2222", "-i", "/k"]
    assert ssh[9:14] == ["-o", "X=y", "--", "10.0.0.2", ssh[-1]]
    # Run the remote line with a python that prints what it got instead of zrun.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, json; print(json.dumps([os.getcwd(), os.environ['NCCL_A'], os.environ['PYTHONX'], sys.argv[1:]]))"
    )
    line = ssh[-1].replace(" py -u -m launcher.zrun ", f" {shlex.quote(sys.executable)} {shlex.quote(str(probe))} ", 1)
    r = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True)
    cwd, a, b, args = json.loads(r.stdout)
    assert cwd == str(d) and a == "v; touch /tmp/zrun_pwned" and b == "it's $(id)"
    assert args[-len(NASTY) :] == NASTY and args[args.index("--node_rank") + 1] == "1"
    assert not os.path.exists("/tmp/zrun_pwned")


def test_local_hosts_run_without_ssh(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "localhost slots=1\n10.0.0.2 slots=1\n")
    cfg = config_from_args(["--hostfile", hf, "--master_addr", "10.0.0.1", "--master_port", "9", "t.py"])
    local, remote = plan_ssh(cfg, {"OMP_NUM_THREADS": "1"}, "/w", "py")
    assert local.argv[:4] == ["py", "-u", "-m", "launcher.zrun"] and local.env == {"OMP_NUM_THREADS": "1"}
    assert remote.argv[0] == "ssh" and remote.env == {}


def test_remote_shell_command_shape() -> None:
    line = remote_shell_command("/w", {}, ["py", "a b"])
    assert line == "cd /w && exec env py 'a b'"


# ---------------------------------------------------------------- exported environment


def test_exported_environment_and_env_files(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("FROM_DS=1\nSHARED=home\n")
    (cwd / ".zrun_env").write_text("# comment\n\nSHARED=cwd wins\nSPACEY=a b = c\n")
    environ = {
        "NCCL_IB_DISABLE": "1",
        "PYTHONPATH": "/p",
        "UCX_TLS": "tcp",
        "MV2_X": "1",
        "GLOO_SOCKET_IFNAME": "eth1",
        "TORCH_SHOW_CPP_STACKTRACES": "1",
        "OMP_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/root",
        "PATH": "/bin",
        "SECRET_TOKEN": "x",
        "CUDA_HOME": "/cuda",
    }
    got = exported_env(environ, [str(home), str(cwd)])
    assert set(got) == {
        "NCCL_IB_DISABLE",
        "PYTHONPATH",
        "UCX_TLS",
        "MV2_X",
        "GLOO_SOCKET_IFNAME",
        "TORCH_SHOW_CPP_STACKTRACES",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "FROM_DS",
        "SHARED",
        "SPACEY",
    }
    assert got["SHARED"] == "cwd wins" and got["SPACEY"] == "a b = c"


@pytest.mark.parametrize(("text", "lineno"), [("OK=1\nnot a pair\n", 2), ("1BAD=x\n", 1), ("A B=1\n", 1)])
def test_env_file_errors_name_file_and_line(tmp_path: Path, text: str, lineno: int) -> None:
    path = tmp_path / ".zrun_env"
    path.write_text(text)
    with pytest.raises(LaunchError, match=f"{path}:{lineno}: bad line .*hint: each line is KEY=VALUE"):
        read_env_file(str(path))


def test_node_argv_carries_the_job(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "n1 slots=1\nn2 slots=1\n")
    cfg = config_from_args(
        [
            "--hostfile",
            hf,
            "--master_port",
            "9",
            "--module",
            "--append_local_rank",
            "--log_dir",
            str(tmp_path),
            "pkg.train",
            "--a",
        ]
    )
    argv = node_zrun_argv(cfg, "py", ["--node_rank", "1"])
    node = config_from_args(argv[4:])
    assert (node.node_rank, node.module, node.append_local_rank, node.log_dir) == (1, True, True, str(tmp_path))
    assert (node.script, node.script_args, node.run_id, node.hosts) == ("pkg.train", ("--a",), cfg.run_id, cfg.hosts)
