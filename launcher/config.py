"""The launch decision as one frozen value: everything `zrun` will do is decided before it starts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Host:
    """One host of the world and the slot ids (device indices on GPU) that zrun will use on it."""

    name: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class LaunchConfig:
    script: str
    script_args: tuple[str, ...] = ()
    # The world, host by host in hostfile order: global ranks are numbered in this order.
    hosts: tuple[Host, ...] = (Host("localhost", (0,)),)
    master_addr: str = "127.0.0.1"
    # None means "the user did not choose": 29500, or (one local node) a free port if that is busy.
    master_port: int | None = None
    module: bool = False
    no_python: bool = False
    append_local_rank: bool = False
    log_dir: str | None = None
    dry_run: bool = False
    # None: this zrun starts every node (through `launcher`). An int: this zrun runs that one node's
    # agent here (one local node, manual mode, or a node started by a controlling zrun).
    node_rank: int | None = 0
    # ssh | pdsh | slurm | openmpi (controller) or local (this node only).
    launcher: str = "local"
    launcher_args: str = ""
    ssh_port: int | None = None
    # Set on nodes started by a controlling zrun: end of stdin (the controller stopped or its ssh
    # connection died) stops this node's ranks. Never set for a user's terminal.
    exit_with_stdin: bool = False
    # Unique per launch and the same on every node: the rendezvous id and the agent's log sub-directory,
    # so a reused --log_dir never mixes two runs' files.
    run_id: str = field(default="zrun")

    @property
    def is_controller(self) -> bool:
        return self.node_rank is None

    @property
    def node(self) -> Host:
        return self.hosts[self.node_rank or 0]

    @property
    def nproc_per_node(self) -> int:
        return len(self.node.slots)

    @property
    def world_size(self) -> int:
        return sum(len(h.slots) for h in self.hosts)
