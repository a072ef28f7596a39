"""Command line -> LaunchConfig. No side effects except reading a --hostfile."""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Sequence

from launcher.config import Host, LaunchConfig
from launcher.errors import LaunchError
from launcher.hostfile import is_local_host, parse_hostfile, select_slots

LAUNCHERS = ("pdsh", "ssh", "openmpi", "mvapich", "slurm", "mpich", "impi")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
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
        description="Start one rank per slot through torch.distributed.run (single node for now).",
    )
    p.add_argument(
        "--num_gpus",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        default=None,
        help="ranks on this node (CPU: processes). Default: CUDA devices, else 1",
    )
    p.add_argument("--master_addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    p.add_argument(
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port (default 29500; a free one if 29500 is busy and none was given)",
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
    multi = p.add_argument_group("multi-node (DeepSpeed flags; more than one node is not implemented yet)")
    multi.add_argument("-H", "--hostfile", default=None, help="lines of 'hostname slots=N'")
    multi.add_argument("-i", "--include", default=None, help="e.g. host1@host2:0,2")
    multi.add_argument("-e", "--exclude", default=None, help="e.g. host1@host2:0,2")
    multi.add_argument("--num_nodes", type=int, default=None)
    multi.add_argument("--launcher", choices=LAUNCHERS, default=None)
    multi.add_argument("--launcher_args", default="")
    multi.add_argument("--ssh_port", type=int, default=None)
    multi.add_argument("--node_rank", type=int, default=None)
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


def _hosts(ns: argparse.Namespace) -> tuple[Host, ...]:
    if ns.hostfile is None:
        if ns.include or ns.exclude:
            raise LaunchError("--include/--exclude need a --hostfile; hint: pass --hostfile or drop them")
        n = ns.nproc if ns.nproc is not None else (_cuda_device_count() or 1)
        return (Host("localhost", tuple(range(n))),)
    try:
        with open(ns.hostfile) as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read --hostfile {ns.hostfile!r}: {e.strerror}") from None
    selected = select_slots(parse_hostfile(text, ns.hostfile), ns.include, ns.exclude)
    hosts = [Host(h, tuple(s)) for h, s in selected.items()]
    if ns.num_nodes is not None and ns.num_nodes > 0:
        hosts = hosts[: ns.num_nodes]  # DeepSpeed: the first N hosts of the hostfile
    if ns.nproc is not None:
        hosts = [Host(h.name, h.slots[: ns.nproc]) for h in hosts]  # DeepSpeed: first N slots per host
    return tuple(hosts)


def _refuse_multi_node(ns: argparse.Namespace, hosts: tuple[Host, ...]) -> None:
    remote = [h.name for h in hosts if not is_local_host(h.name)]
    if len(hosts) > 1 or remote or (ns.num_nodes or 1) > 1:
        names = ", ".join(h.name for h in hosts)
        raise LaunchError(
            f"multi-node launch is not implemented yet (asked for {max(len(hosts), ns.num_nodes or 1)} "
            f"node(s): {names}); hint: run on one node, e.g. a hostfile with the single line "
            f"'localhost slots=N', or --include localhost"
        )
    if ns.node_rank not in (None, 0, -1):
        raise LaunchError(
            f"--node_rank {ns.node_rank}: a single-node launch is node 0; hint: drop --node_rank"
        )


def config_from_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    ns = build_parser().parse_args(argv)
    if ns.nproc is not None and ns.nproc < 1:
        raise LaunchError(f"--num_gpus/--nproc_per_node must be >= 1, got {ns.nproc}")
    if ns.module and ns.no_python:
        raise LaunchError("--module and --no_python contradict each other; hint: use one")
    hosts = _hosts(ns)
    _refuse_multi_node(ns, hosts)
    return LaunchConfig(
        script=ns.script,
        script_args=tuple(ns.script_args),
        hosts=(Host("localhost", hosts[0].slots),),
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        module=ns.module,
        no_python=ns.no_python,
        append_local_rank=ns.append_local_rank,
        log_dir=os.path.abspath(ns.log_dir) if ns.log_dir else None,
        dry_run=ns.dry_run,
        hostfile=ns.hostfile,
        include=ns.include,
        exclude=ns.exclude,
        num_nodes=ns.num_nodes,
        launcher=ns.launcher,
        launcher_args=ns.launcher_args,
        ssh_port=ns.ssh_port,
        node_rank=ns.node_rank,
        run_id=f"zrun-{uuid.uuid4().hex[:12]}",
    )
