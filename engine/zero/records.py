"""What one rank holds of the training state, described by parameter name and global element offset.

Every stage answers `checkpoint_shards()` with `ShardRecord`s: a tensor this rank holds (an fp32
master shard with its optimizer state, or a stage-3 shard of frozen parameters) and the pieces of
named parameters laid end to end in it. Saving writes each piece under the parameter's name and
offset; loading fills each piece from whatever pieces the checkpoint has for that name. So a
checkpoint never depends on bucket or rank positions: it loads at any world size and any stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.zero.layout import GroupLayout


@dataclass(frozen=True)
class NamedPiece:
    name: str
    """The parameter's name in module.state_dict()."""
    param_offset: int
    """First element within the flattened parameter."""
    tensor_offset: int
    """First element within the record's flattened tensor."""
    numel: int


@dataclass
class ShardRecord:
    tensor: torch.Tensor
    """An fp32 master (the optimizer's parameter; its state tensors have its shape), or, when
    opt_group is None, a shard of frozen parameters in their own dtype. Row-major order is the
    pieces' order."""
    pieces: list[NamedPiece]
    opt_group: int | None
    write: bool
    """False where another rank holds the same values (replicated stages: rank 0 writes)."""


def layout_pieces(layout: GroupLayout, rank: int, names: list[str]) -> list[NamedPiece]:
    """The pieces of `rank`'s shard of a flat group (engine/zero/layout.py), named."""
    return [NamedPiece(names[p.param], p.param_offset, p.shard_offset, p.numel) for p in layout.rank_pieces(rank)]
