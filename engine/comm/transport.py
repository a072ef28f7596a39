"""Point-to-point sends and receives for engine/comm/p2p.py and ring.py, addressed by position.

The direct-exchange and ring collectives move bytes through a transport they are given, so they never
call the distributed package: these two are the transports, torch's isend/irecv on the default group
(peer = global rank) or on a subgroup (peer = position in the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm.lifecycle import get_rank


class TorchTransport:
    """torch.distributed's point-to-point calls on the default group."""

    @staticmethod
    def isend(tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return _issued(dist.isend(tensor, peer, tag=tag), "isend")

    @staticmethod
    def irecv(tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return _issued(dist.irecv(tensor, peer, tag=tag), "irecv")


def _issued(work: dist.Work | None, op: str) -> dist.Work:
    # torch returns no handle only to a rank outside the group, and these calls use the default
    # group, which holds every rank.
    if work is None:
        raise RuntimeError(
            f"torch.distributed.{op} returned no handle: rank {get_rank()} is not in the default process group"
        )
    return work


class GroupTransport:
    """Point-to-point calls addressed by position in a group (what engine/comm/p2p.py speaks)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        """Global ranks, in group order."""

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return TorchTransport.isend(tensor, self.ranks[peer], tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return TorchTransport.irecv(tensor, self.ranks[peer], tag)
