"""Subgroups (tensor x data parallel): made or adopted by name, so comm_stats() counts each one's traffic
under "<name>.<op>" and the engine's own collectives can address their members by position."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.comm import torch_nn_gloo
from engine.comm.lifecycle import get_rank, get_world_size
from engine.comm.state import STATE
from engine.comm.transport import GroupTransport


@dataclass(frozen=True)
class Subgroup:
    name: str
    """What its traffic is counted under in comm_stats(): "<name>.<op>"."""
    transport: GroupTransport
    """Point-to-point calls addressed by position in the group (it holds the members' global ranks)."""


def new_group(ranks: Sequence[int] | None = None, name: str = "group") -> ProcessGroup:
    """A process group of the given global ranks (None: every rank), whose traffic comm_stats() counts
    under "<name>.<op>". Every rank of the world must make every group, in the same order (torch's
    rule), also the groups it is not in; it gets back a group it cannot use then."""
    members = sorted(range(get_world_size()) if ranks is None else ranks)
    torch_nn_gloo.install()  # client code hands these groups to torch.distributed.nn (torch_nn_gloo.py says why)
    group = dist.new_group(ranks=members)
    STATE.subgroups[group] = Subgroup(name, GroupTransport(members))
    return group


def adopt_group(group: ProcessGroup, name: str) -> None:
    """Record a group this module did not make (a user's mpu made it with torch.distributed.new_group),
    so collectives on it work on every implementation and comm_stats() counts its traffic under
    "<name>.<op>". A group made by new_group keeps its name."""
    if group not in STATE.subgroups:
        torch_nn_gloo.install()
        STATE.subgroups[group] = Subgroup(name, GroupTransport(list(dist.get_process_group_ranks(group))))


def subgroup(group: ProcessGroup) -> Subgroup:
    if group not in STATE.subgroups:
        adopt_group(group, "group")
    return STATE.subgroups[group]


def get_world_group() -> ProcessGroup:
    """The default group as a group object (collectives given it behave as given None)."""
    world = dist.GroupMember.WORLD
    if world is None:
        raise RuntimeError("no default process group: call init_distributed() first")
    return world


def is_world(group: ProcessGroup | None) -> bool:
    """None and the default group's object both mean every rank: one sequence of collectives, one
    name in comm_stats()."""
    return group is None or group is dist.GroupMember.WORLD


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of the member at position `group_rank` of `group` (None: the world)."""
    ranks = group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"group rank {group_rank} is not in a group of {len(ranks)} ranks {ranks}")
    return ranks[group_rank]


def generation() -> int:
    """Changes whenever destroy_process_group() ends the default group (and with it every subgroup)."""
    return STATE.generation


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in `group` (None: the world)."""
    return get_world_size() if is_world(group) else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's position in `group` (None: its global rank)."""
    return get_rank() if is_world(group) else dist.get_rank(group)


def group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group`, in group order."""
    if group is None or is_world(group):
        return list(range(get_world_size()))
    return list(subgroup(group).transport.ranks)
