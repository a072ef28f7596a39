"""`engine.zero.GatheredParameters`: whole stage-3 parameters on every rank for the length of a block.

    with engine.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.data.normal_()      # scattered back to every rank's shard on exit

Every rank must enter the block (it all-gathers). Parameters that are not partitioned (stages 0-2)
are whole already; with modifier_rank they are broadcast from that rank on exit (and an engine's
fp32 master copy refreshed), so every rank keeps the same model and the same code runs at every stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from engine import comm
from engine.zero import owners, partitioned_init
from engine.zero.base import MasterOwner
from engine.zero.owners import UnitHandle


@contextlib.contextmanager
def GatheredParameters(
    params: torch.Tensor | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    fwd_module: object = None,
    enabled: bool = True,
) -> Iterator[None]:
    """Gather the units holding `params`; with modifier_rank, broadcast that rank's values on exit and
    write each rank's slice back into its shard (and fp32 master)."""
    del fwd_module  # DeepSpeed uses it to register external parameters; gathered units need no registry
    if not enabled:
        yield
        return
    params = [params] if torch.is_tensor(params) else list(params)
    units: dict[int, UnitHandle] = {}
    for p in params:
        handle = owners.unit_of(p)
        if handle is not None:
            units.setdefault(id(handle), handle)
    # Built under engine.zero.Init and not yet given to an engine: partitioned one by one.
    loose = [p for p in {id(p): p for p in params}.values() if partitioned_init.is_partitioned(p)]
    for p in loose:
        partitioned_init.unpartition(p)
    opened: list[UnitHandle] = []
    try:
        for handle in units.values():
            if handle.gather():
                opened.append(handle)
        yield
        if modifier_rank is not None:
            for handle in units.values():
                handle.scatter_from(modifier_rank)
            whole = [p for p in params if owners.unit_of(p) is None and not any(p is q for q in loose)]
            if whole:
                comm.broadcast_coalesced([p.data for p in whole], src=modifier_rank)
                masters: dict[int, MasterOwner] = {}
                for p in whole:
                    if (owner := owners.masters_of(p)) is not None:
                        masters.setdefault(id(owner), owner)
                for owner in masters.values():
                    owner.refresh_masters()
        partitioned_init.partition(loose, src=modifier_rank)
    finally:
        partitioned_init.partition(loose, src=None)  # after an error: no collective, only this rank's slices
        for handle in opened:
            handle.release()
