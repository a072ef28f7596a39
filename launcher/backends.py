"""How a controlling zrun starts the nodes: one ssh per node, or one pdsh / srun / mpirun for all.

Every node runs the same program, `python -m launcher.zrun` in node mode, with the whole world on
its command line; the backends differ only in how that command reaches the node and how the node
learns its rank (an explicit --node_rank over ssh, pdsh's %h, SLURM_NODEID, OMPI_COMM_WORLD_RANK).
Every value that passes through a remote shell is quoted with shlex.quote: a host name, path,
argument or environment value can never become a second command.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher.config import LaunchConfig
from launcher.hostfile import format_world, is_local_host

# ssh must never prompt (a prompt on a hidden terminal is a hang) and must give up on a dead host.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


@dataclass(frozen=True)
class NodeLaunch:
    """One process the controller starts: a node (ssh, local) or every node at once (pdsh/srun/mpirun)."""

    label: str  # how messages name it: "node 1 (10.0.0.2)" or "srun (2 nodes)"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the controller's environment
    node_rank: int | None = None  # None: this process runs every node
    # The controller keeps the child's stdin open while the job runs and closes it to stop the node:
    # the node's zrun (--exit_with_stdin) stops its ranks at end of input, even through ssh.
    stdin_stop: bool = False


def node_zrun_argv(cfg: LaunchConfig, python: str, how: list[str]) -> list[str]:
    """The node-mode zrun command line; `how` tells the node which one it is."""
    assert cfg.master_port is not None
    argv = [python, "-u", "-m", "launcher.zrun", *how, "--world", format_world(cfg.hosts)]
    argv += ["--master_addr", cfg.master_addr, "--master_port", str(cfg.master_port)]
    argv += ["--rdzv_id", cfg.run_id]
    if cfg.log_dir:
        argv += ["--log_dir", cfg.log_dir]
    for flag, on in (("--module", cfg.module), ("--no_python", cfg.no_python)):
        if on:
            argv.append(flag)
    if cfg.append_local_rank:
        argv.append("--append_local_rank")
    return [*argv, cfg.script, *cfg.script_args]


def remote_shell_command(cwd: str, env: Mapping[str, str], argv: list[str]) -> str:
    """One POSIX shell line: same directory, the exported variables, then exec the node's zrun."""
    words = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def ssh_argv(cfg: LaunchConfig, host: str, command: str) -> list[str]:
    port = ["-p", str(cfg.ssh_port)] if cfg.ssh_port else []
    # `--` ends ssh's options: what follows is the host and the command, whatever they look like.
    return ["ssh", *SSH_OPTIONS, *port, *shlex.split(cfg.launcher_args), "--", host, command]


def plan_ssh(cfg: LaunchConfig, exports: dict[str, str], cwd: str, python: str) -> list[NodeLaunch]:
    plans = []
    for k, host in enumerate(cfg.hosts):
        argv = node_zrun_argv(cfg, python, ["--node_rank", str(k), "--exit_with_stdin"])
        label = f"node {k} ({host.name})"
        if is_local_host(host.name):
            plans.append(NodeLaunch(label, argv, exports, k, stdin_stop=True))
        else:
            command = remote_shell_command(cwd, exports, argv)
            plans.append(NodeLaunch(label, ssh_argv(cfg, host.name, command), {}, k, stdin_stop=True))
    return plans


def plan_pdsh(
    cfg: LaunchConfig, exports: dict[str, str], cwd: str, python: str, environ: Mapping[str, str] = os.environ
) -> list[NodeLaunch]:
    # pdsh substitutes %h (the target host) in the command: each node finds itself in --world by
    # name. Every literal % must be doubled or pdsh would substitute it too.
    argv = node_zrun_argv(cfg, python, ["--node_name", "__HOST__"])
    command = remote_shell_command(cwd, exports, argv).replace("%", "%%").replace("__HOST__", "%h")
    ours = shlex.join([*SSH_OPTIONS, *(["-p", str(cfg.ssh_port)] if cfg.ssh_port else [])])
    ssh_args = f"{environ['PDSH_SSH_ARGS_APPEND']} {ours}" if environ.get("PDSH_SSH_ARGS_APPEND") else ours
    pdsh = ["pdsh", "-S", "-f", "1024", "-w", ",".join(h.name for h in cfg.hosts)]
    env = {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": ssh_args}
    label = f"pdsh ({len(cfg.hosts)} nodes)"
    return [NodeLaunch(label, [*pdsh, *shlex.split(cfg.launcher_args), command], env)]


def plan_slurm(cfg: LaunchConfig, exports: dict[str, str], cwd: str, python: str) -> list[NodeLaunch]:
    n = len(cfg.hosts)
    srun = [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",  # one agent per node; the agent starts the node's ranks
        "--kill-on-bad-exit=1",  # one failed node ends the step on every node
        f"--nodelist={','.join(h.name for h in cfg.hosts)}",
        f"--chdir={cwd}",
        "--export=ALL",
        *shlex.split(cfg.launcher_args),
    ]
    argv = node_zrun_argv(cfg, python, ["--node_rank_from", "SLURM_NODEID"])
    return [NodeLaunch(f"srun ({n} nodes)", [*srun, *argv], exports)]


def plan_openmpi(cfg: LaunchConfig, exports: dict[str, str], cwd: str, python: str) -> list[NodeLaunch]:
    n = len(cfg.hosts)
    mpirun = [
        "mpirun",
        "-n",
        str(n),
        "--map-by",
        "ppr:1:node",  # one agent per node, in --host order, so MPI rank = node rank
        "--bind-to",
        "none",  # the agent's ranks share the node's cores; mpirun would pin the agent to one
        "--host",
        ",".join(f"{h.name}:1" for h in cfg.hosts),
        "--wdir",
        cwd,
    ]
    for key in exports:
        mpirun += ["-x", key]  # mpirun copies the value from its own environment (given below)
    if cfg.ssh_port:
        mpirun += ["--mca", "plm_rsh_args", f"-p {cfg.ssh_port}"]
    argv = node_zrun_argv(cfg, python, ["--node_rank_from", "OMPI_COMM_WORLD_RANK"])
    return [NodeLaunch(f"mpirun ({n} nodes)", [*mpirun, *shlex.split(cfg.launcher_args), *argv], exports)]


PLANNERS = {"ssh": plan_ssh, "pdsh": plan_pdsh, "slurm": plan_slurm, "openmpi": plan_openmpi}
# The program each backend needs on the launching machine.
BACKEND_PROGRAM = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "openmpi": "mpirun"}
