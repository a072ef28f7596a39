"""Point-to-point sends and receives for user code (torch.distributed's and deepspeed.comm's send, recv,
isend, irecv), each send counted for comm_stats() as "send" ("<group>.send" on a subgroup).

`dst` and `src` are global ranks, also with a group, as in torch. The engine's own collectives on gloo
are point-to-point transfers on the default group too (transport.py), tagged by sequence number and
checksum (p2p.Signature.tag): wait for a user transfer before issuing the next collective and the two
never meet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.comm.collectives import Work, count_sent


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    count_sent("send", tensor.numel() * tensor.element_size(), group)
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> int:
    """Receive into `tensor` from global rank `src` (None: any); returns the sender's rank."""
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work | None:
    """Start a send; wait() on the handle before touching `tensor` (None on a rank outside `group`)."""
    count_sent("send", tensor.numel() * tensor.element_size(), group)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> Work | None:
    return dist.irecv(tensor, src, group=group, tag=tag)
