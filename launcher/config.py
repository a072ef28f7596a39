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
    # The world. For now exactly one host (this one); multi-node fills in more and uses node_rank.
    hosts: tuple[Host, ...] = (Host("localhost", (0,)),)
    master_addr: str = "127.0.0.1"
    # None means "the user did not choose": run.py then takes 29500, or a free port if that is busy.
    master_port: int | None = None
    module: bool = False
    no_python: bool = False
    append_local_rank: bool = False
    log_dir: str | None = None
    dry_run: bool = False
    # Multi-node options, parsed now so DeepSpeed command lines are accepted; used by a later issue.
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    launcher: str | None = None
    launcher_args: str = ""
    ssh_port: int | None = None
    node_rank: int | None = None
    # Unique per launch: names the agent's log sub-directory (and later the rendezvous) so a reused
    # --log_dir never mixes two runs' files.
    run_id: str = field(default="zrun")

    @property
    def nproc_per_node(self) -> int:
        return len(self.hosts[0].slots)

    @property
    def world_size(self) -> int:
        return sum(len(h.slots) for h in self.hosts)
