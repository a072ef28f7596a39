"""Command line -> LaunchConfig. No side effects except reading a --hostfile."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from typing import NoReturn

from launcher.config import Host, LaunchConfig
from launcher.errors import LaunchError
from launcher.hostfile import is_local_host, parse_hostfile, parse_world, select_slots
from launcher.slurm import slurm_hosts

# The backends zrun starts nodes with; "local" runs this node only (manual mode).
LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi", "local")
# DeepSpeed's other MPI flavours: named so the error can say what to use instead.
_NOT_BUILT = ("mvapich", "mpich", "impi")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's default usage dump buries the one line that matters; say it once, with a hint.
        self.exit(
            2,
            f"zrun: error: {message}\nzrun: hint: zrun options go before the script; "
            f"everything after the script is passed to it untouched. See `zrun --help`.\n",
        )


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: `--num` must not silently mean `--num_gpus` (and script flags never reach here).
    p = _Parser(
        prog="zrun",
        allow_abbrev=False,
        description=(
            "Start one rank per slot through torch.distributed.run, on this node or on every host "
            "of a --hostfile (ssh, pdsh, SLURM srun or mpirun)."
        ),
    )
    p.add_argument(
        "--num_gpus",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        default=None,
        help="ranks on this node (CPU: processes). Default: CUDA devices, else 1",
    )
    p.add_argument(
        "--master_addr",
        default=None,
        help="rendezvous address: node 0's address (default: 127.0.0.1 on one node, else the first host)",
    )
    p.add_argument(
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port (default 29500; on one node a free one if 29500 is busy and none was given)",
    )
    p.add_argument("--module", action="store_true", help="run the script as `python -m script`")
    p.add_argument("--no_python", action="store_true", help="execute the script directly, not with python")
    p.add_argument(
        "--log_dir",
        "--enable_each_rank_log",
        dest="log_dir",
        default=None,
        help="keep per-rank stdout/stderr log files under this directory",
    )
    p.add_argument(
        "--append_local_rank",
        action="store_true",
        help="append --local_rank=N to the script's argv (old DeepSpeed scripts); off by default",
    )
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="DeepSpeed compatibility: accepted and ignored (not appending is the default)",
    )
    p.add_argument("--dry_run", action="store_true", help="print the agent command and environment, exit 0")
    multi = p.add_argument_group("multi-node (DeepSpeed's and torchrun's flags)")
    multi.add_argument("-H", "--hostfile", default=None, help="lines of 'hostname slots=N'")
    multi.add_argument("-i", "--include", default=None, help="hosts/slots to use, e.g. host1@host2:0,2")
    multi.add_argument("-e", "--exclude", default=None, help="hosts/slots to leave out, e.g. host1@host2:0,2")
    multi.add_argument(
        "--num_nodes",
        "--nnodes",
        dest="num_nodes",
        type=int,
        default=None,
        help="use the first N hosts of the hostfile; without one (manual mode): the number of nodes",
    )
    multi.add_argument(
        "--launcher",
        choices=LAUNCHERS + _NOT_BUILT,
        default=None,
        help="how nodes are started (default ssh for a multi-node hostfile); local: this node only",
    )
    multi.add_argument(
        "--launcher_args",
        default="",
        help="extra arguments for ssh / pdsh / srun / mpirun, as one shell-quoted string",
    )
    multi.add_argument("--ssh_port", type=int, default=None, help="ssh port of every host")
    multi.add_argument(
        "--node_rank",
        type=int,
        default=None,
        help="manual mode: run only this node's ranks here (start zrun on every node yourself)",
    )
    multi.add_argument("--rdzv_endpoint", default=None, help="torchrun style HOST:PORT (= --master_addr/--master_port)")
    multi.add_argument("--rdzv_id", default=None, help="job id, the same on every node (default: a fresh one)")
    # Used by a controlling zrun to start a node; documented for the curious, not for daily use.
    node = p.add_argument_group("set by zrun on the nodes it starts")
    node.add_argument("--world", default=None, help="the whole world as host:slots@host:slots")
    node.add_argument("--node_name", default=None, help="this node's name in --world (pdsh passes %%h)")
    node.add_argument("--node_rank_from", default=None, metavar="VAR", help="read --node_rank from $VAR")
    node.add_argument("--exit_with_stdin", action="store_true", help="stop every rank when stdin closes")
    p.add_argument("script", help="the training script (or module with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script untouched")
    return p


def _cuda_device_count() -> int:
    # Imported lazily: torch costs seconds to import and is only needed when the user gave no count.
    try:
        import torch

        return torch.cuda.device_count()
    except (ImportError, RuntimeError):  # no torch, or a broken CUDA driver: plan for CPU
        return 0


def _default_nproc(ns: argparse.Namespace) -> int:
    return ns.nproc if ns.nproc is not None else (_cuda_device_count() or 1)


def _hostfile_hosts(ns: argparse.Namespace) -> tuple[Host, ...]:
    try:
        with open(ns.hostfile) as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read --hostfile {ns.hostfile!r}: {e.strerror}") from None
    selected = select_slots(parse_hostfile(text, ns.hostfile), ns.include, ns.exclude)
    hosts = [Host(h, tuple(s)) for h, s in selected.items()]
    if ns.num_nodes is not None and ns.num_nodes > 0:
        if ns.num_nodes > len(hosts):
            raise LaunchError(
                f"--num_nodes {ns.num_nodes}: the hostfile {ns.hostfile} (after --include/--exclude) has "
                f"only {len(hosts)} host(s); hint: add hosts or lower --num_nodes"
            )
        hosts = hosts[: ns.num_nodes]  # DeepSpeed: the first N hosts of the hostfile
    if ns.nproc is not None:
        hosts = [Host(h.name, h.slots[: ns.nproc]) for h in hosts]  # DeepSpeed: first N slots per host
    return tuple(hosts)


def _hosts(ns: argparse.Namespace) -> tuple[Host, ...]:
    if ns.world is not None:
        return parse_world(ns.world)
    if ns.hostfile is not None:
        if ns.launcher == "slurm":
            # srun numbers nodes (SLURM_NODEID) by the allocation, not by a hostfile's order.
            raise LaunchError(
                "--launcher slurm takes its nodes from the SLURM allocation, not from --hostfile; "
                "hint: drop --hostfile (use --num_nodes to run on the first N nodes)"
            )
        return _hostfile_hosts(ns)
    if ns.include or ns.exclude:
        raise LaunchError("--include/--exclude need a --hostfile; hint: pass --hostfile or drop them")
    if ns.launcher == "slurm":
        return slurm_hosts(os.environ, _default_nproc(ns), ns.num_nodes)
    n, nodes = _default_nproc(ns), ns.num_nodes or 1
    if nodes == 1:
        return (Host("localhost", tuple(range(n))),)
    # Manual mode without a hostfile: the nodes' names are unknown (each zrun only runs its own).
    return tuple(Host(f"node{k}", tuple(range(n))) for k in range(nodes))


def _node_rank(ns: argparse.Namespace, hosts: tuple[Host, ...]) -> int | None:
    """Which node this zrun runs, or None when it starts them all."""
    if ns.node_rank_from is not None:
        value = os.environ.get(ns.node_rank_from, "")
        if not value.isdigit():
            raise LaunchError(
                f"--node_rank_from {ns.node_rank_from}: ${ns.node_rank_from} is {value or 'unset'!r}, "
                f"not a node number; hint: this flag is for nodes started by srun/mpirun"
            )
        rank = int(value)
    elif ns.node_name is not None:
        names = [h.name for h in hosts]
        if ns.node_name not in names:
            raise LaunchError(f"--node_name {ns.node_name!r} is not one of the world's hosts {names}")
        rank = names.index(ns.node_name)
    elif ns.node_rank is not None and ns.node_rank >= 0:
        rank = ns.node_rank
    elif ns.launcher in ("ssh", "pdsh", "slurm", "openmpi"):
        return None  # an explicit backend starts the nodes, even a single one
    elif len(hosts) == 1 and is_local_host(hosts[0].name):
        return 0
    elif ns.launcher == "local":
        raise LaunchError(f"--launcher local runs one node of {len(hosts)}; hint: say which with --node_rank K")
    else:
        return None
    if not 0 <= rank < len(hosts):
        raise LaunchError(
            f"node rank {rank} is outside the world of {len(hosts)} node(s); hint: --node_rank is 0..{len(hosts) - 1}"
        )
    return rank


def _master_addr(ns: argparse.Namespace, hosts: tuple[Host, ...], node_rank: int | None) -> str:
    if ns.master_addr is not None:
        return str(ns.master_addr)
    if len(hosts) == 1 and is_local_host(hosts[0].name):
        return "127.0.0.1"
    first = hosts[0].name
    if ns.hostfile is None and ns.world is None and ns.launcher != "slurm":
        raise LaunchError(
            f"node {node_rank} of {len(hosts)}: the master's address is unknown; "
            f"hint: pass --master_addr (node 0's address) on every node"
        )
    if is_local_host(first):
        raise LaunchError(
            f"the first host {first!r} (node 0, where the rendezvous runs) is named by a loopback name "
            f"that the other nodes cannot reach; hint: name it by its address in the hostfile, or pass "
            f"--master_addr with an address they can reach"
        )
    return first  # DeepSpeed: the first host of the hostfile


def _launcher(ns: argparse.Namespace, node_rank: int | None) -> str:
    if ns.launcher in _NOT_BUILT:
        raise LaunchError(f"--launcher {ns.launcher} is not supported; hint: use --launcher openmpi (mpirun) or ssh")
    if node_rank is not None:
        return "local"
    return str(ns.launcher or "ssh")


def split_at_script(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """zrun's own options (with `--launcher_args "-i key"` glued to `--launcher_args=-i key`, which
    argparse would read as --include), and the script with its arguments, verbatim.

    argparse never sees the script's arguments: it would drop a `--` right after the script, and
    with abbreviations on (torch's parser) it reads `--log 1` as an ambiguous option.
    """
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    own, i = [], 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] == "--":
            i += 1  # an explicit end of zrun's options: the script comes next, whatever its name
            break
        if argv[i] == "--launcher_args" and i + 1 < len(argv):
            own.append(f"--launcher_args={argv[i + 1]}")
            i += 2
            continue
        own.append(argv[i])
        if argv[i] in takes_value and i + 1 < len(argv):
            own.append(argv[i + 1])  # the option's value, even one that starts with '-'
            i += 1
        i += 1
    return own, argv[i:]


def _port(flag: str, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise LaunchError(f"{flag} {value}: a TCP port is 1-65535; hint: pass a port in that range")


def _check_numbers(ns: argparse.Namespace, given: list[str]) -> None:
    """Every numeric flag in range, named as the user spelled it (argparse only checks int-ness)."""

    def spelled(*names: str) -> str:
        return next((a.split("=")[0] for a in reversed(given) if a.split("=")[0] in names), names[0])

    if ns.nproc is not None and ns.nproc < 1:
        raise LaunchError(
            f"{spelled('--num_gpus', '--nproc_per_node')} {ns.nproc}: ranks per node must be >= 1; "
            f"hint: omit it to use one rank per CUDA device (or 1 on CPU)"
        )
    if ns.num_nodes is not None and ns.num_nodes < 1:
        raise LaunchError(
            f"{spelled('--num_nodes', '--nnodes')} {ns.num_nodes}: the number of nodes must be >= 1; "
            f"hint: omit it to use every host"
        )
    _port("--master_port", ns.master_port)
    _port("--ssh_port", ns.ssh_port)
    if ns.node_rank is not None and ns.node_rank < 0:
        last = (ns.num_nodes or 1) - 1
        raise LaunchError(f"--node_rank {ns.node_rank}: node ranks are 0..{last}; hint: pass 0 on the first node")


def config_from_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    parser = build_parser()
    own, script = split_at_script(parser, list(sys.argv[1:] if argv is None else argv))
    # `--` keeps a script named like an option a positional; the script's own arguments stay out.
    ns = parser.parse_args([*own, "--", *script[:1]])
    ns.script_args = script[1:]
    _check_numbers(ns, own)
    if ns.module and ns.no_python:
        raise LaunchError("--module and --no_python contradict each other; hint: use one")
    if ns.rdzv_endpoint is not None:
        addr, _, port = ns.rdzv_endpoint.rpartition(":")
        if not addr or not port.isdigit():
            raise LaunchError(f"--rdzv_endpoint {ns.rdzv_endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
        _port(f"--rdzv_endpoint {ns.rdzv_endpoint}: port", int(port))
        ns.master_addr = ns.master_addr or addr
        ns.master_port = ns.master_port or int(port)
    hosts = _hosts(ns)
    node_rank = _node_rank(ns, hosts)
    if ns.exit_with_stdin and node_rank is None:
        raise LaunchError("--exit_with_stdin is for one node; hint: it is set by zrun on the nodes it starts")
    return LaunchConfig(
        script=ns.script,
        script_args=tuple(ns.script_args),
        hosts=hosts,
        master_addr=_master_addr(ns, hosts, node_rank),
        master_port=ns.master_port,
        module=ns.module,
        no_python=ns.no_python,
        append_local_rank=ns.append_local_rank,
        log_dir=os.path.abspath(ns.log_dir) if ns.log_dir else None,
        dry_run=ns.dry_run,
        node_rank=node_rank,
        launcher=_launcher(ns, node_rank),
        launcher_args=ns.launcher_args,
        ssh_port=ns.ssh_port,
        exit_with_stdin=ns.exit_with_stdin,
        run_id=ns.rdzv_id or f"zrun-{uuid.uuid4().hex[:12]}",
    )
