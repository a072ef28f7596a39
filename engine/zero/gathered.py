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

from engine.zero import init as zero_init


def owner_of(param: torch.Tensor) -> tuple[object, object] | None:
    """(stage, unit) of a stage-3 parameter, or None."""
    return getattr(param, "_zero_owner", None)


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                       fwd_module: object = None, enabled: bool = True) -> Iterator[None]:
    """Gather the units holding `params`; with modifier_rank, broadcast that rank's values on exit and
    write each rank's slice back into its shard (and fp32 master)."""
    del fwd_module  # DeepSpeed uses it to register external parameters; gathered units need no registry
    if not enabled:
        yield
        return
    params = [params] if torch.is_tensor(params) else list(params)
    units: dict[int, tuple[object, object]] = {}
    for p in params:
        owner = owner_of(p)
        if owner is not None:
            units.setdefault(id(owner[1]), owner)
    # Built under engine.zero.Init and not yet given to an engine: partitioned one by one.
    loose = [p for p in {id(p): p for p in params}.values() if zero_init.is_partitioned(p)]
    for p in loose:
        zero_init.unpartition(p)
    opened = []
    try:
        for stage, unit in units.values():
            if stage.gather_for_user(unit):  # type: ignore[attr-defined]
                opened.append((stage, unit))
        yield
        if modifier_rank is not None:
            for stage, unit in units.values():
                stage.scatter_from(unit, modifier_rank)  # type: ignore[attr-defined]
            whole = [p for p in params if owner_of(p) is None and not any(p is q for q in loose)]
            if whole:
                from engine import comm

                comm.broadcast_coalesced([p.data for p in whole], src=modifier_rank)
                for stage in {id(s): s for s in (getattr(p, "_zero_masters", None) for p in whole) if s}.values():
                    stage.refresh_masters()
        zero_init.partition(loose, src=modifier_rank)
    finally:
        zero_init.partition(loose, src=None)  # after an error: no collective, only this rank's slices
        for stage, unit in opened:
            stage.release_for_user(unit)  # type: ignore[attr-defined]
