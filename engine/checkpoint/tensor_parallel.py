"""Checkpoints under tensor parallelism: the names a rank's tensors are saved under, what the manifest
records of the slices (its `tensor_parallel` section), and the check every load makes first.

# [Note: checkpoint names under tensor parallelism]
ZeRO partitions each parameter over the data-parallel group, so the ranks of one data-parallel group
(one tensor-parallel rank r) hold r's slices between them, and their pieces cover each slice as the
pieces of a run without tensor parallelism cover a whole parameter. So r's pieces of a
tensor-parallel tensor are saved under `slice_name(name, r)` (`<name>@tp<r>`): for each r they are
exactly a checkpoint of tensors of those names, and the resharding reader (piece_reader.py) reads
them back at any data-parallel size and stage unchanged, each rank asking for its own r's names
only. A replicated tensor (a layer norm, a row-parallel bias, an embedding not split) is the same on
every tensor-parallel rank: the ranks of tensor-parallel rank 0 write it under its own name, the
others skip it, and every rank reads it. `slice_name` is the one place the scheme is written;
readers take the names from the manifest (`tensor_parallel.params.<name>.saved_as`), never by
parsing them. Without tensor parallelism nothing is renamed and the manifest says size 1.

A checkpoint saved at another tensor-parallel size, or with tensors split otherwise than here (a
tensor sliced there and replicated here, another partition_dim, DeepSpeed's AutoTP choices), loads
too (`reader_for`): every slice is re-cut from the whole tensor, masters and optimizer state alike
(engine/checkpoint/tp_recut.py). What is refused by name, before anything is read, is a model that
does not match: another whole shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.checkpoint.files import CheckpointError, joined_shape, tp_section
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.tp_recut import RecutReader, plan_recuts
from engine.parallel.groups import ParallelGroups
from engine.parallel.layers import is_tensor_parallel
from engine.zero.partitioned_init import full_shape
from engine.zero.records import ShardRecord

SpecRow = tuple[int, dict[str, list[Any]]]
"""What one rank tells the manifest (all-gathered): its tensor-parallel rank and, per tensor-parallel
tensor, [partition_dim, partition_stride, slice shape]."""


def slice_name(name: str, tp_rank: int) -> str:
    """The name tensor-parallel rank `tp_rank`'s slice of tensor `name` is saved under."""
    return f"{name}@tp{tp_rank}"


@dataclass(frozen=True)
class SliceSpec:
    """One tensor-parallel tensor on this rank: Megatron's attributes and the slice's shape."""

    dim: int
    """partition_dim: the dimension the tensor is split along (normalised to >= 0)."""
    stride: int
    """partition_stride: chunks per slice (3 for a fused qkv; engine/zero/tp_state.py)."""
    shape: tuple[int, ...]
    """This rank's slice, whole (at stage 3 its ds_shape, not its released .data)."""


def _slice_spec(tensor: torch.Tensor) -> SliceSpec:
    shape = full_shape(tensor)
    dim = int(getattr(tensor, "partition_dim", 0))
    return SliceSpec(dim % len(shape) if shape else 0, int(getattr(tensor, "partition_stride", 1)), shape)


@dataclass(frozen=True)
class CheckpointNames:
    """Which of this rank's tensors it writes, and under which names. See [Note: checkpoint names under
    tensor parallelism]."""

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    sliced: Mapping[str, SliceSpec]
    """Every state-dict name (tied names too) of a tensor-parallel tensor; empty at tensor-parallel
    size 1, where a slice is the whole tensor."""

    @classmethod
    def of(cls, module: torch.nn.Module, parallel: ParallelGroups) -> CheckpointNames:
        sliced = (
            {name: _slice_spec(t) for name, t in module.state_dict(keep_vars=True).items() if is_tensor_parallel(t)}
            if parallel.tp_size > 1
            else {}
        )
        return cls(parallel.tp_size, parallel.dp_size, parallel.tp_rank, parallel.dp_rank, sliced)

    def whole_shapes(self, module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """Every state-dict tensor's whole shape: a tensor-parallel slice's joined over the ranks."""
        shapes = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            shape, spec = list(full_shape(tensor)), self.sliced.get(name)
            if spec is not None and shape:
                shape[spec.dim] *= self.tp_size
            shapes[name] = tuple(shape)
        return shapes

    def saved_name(self, name: str) -> str:
        return slice_name(name, self.tp_rank) if name in self.sliced else name

    def writes(self, name: str) -> bool:
        """Whether this rank's values of `name` go into the checkpoint: a replicated tensor's only from
        tensor-parallel rank 0 (the others hold the same values)."""
        return name in self.sliced or self.tp_rank == 0

    def writes_whole(self) -> bool:
        """Whether this rank writes whole tensors (buffers, frozen parameters at stages 0-2): the first
        rank of each data-parallel group, whose members hold the same ones (rank 0 alone without TP)."""
        return self.dp_rank == 0

    def for_saving(self, records: list[ShardRecord]) -> list[ShardRecord]:
        """The stage's records with the pieces this rank writes, under their saved names."""
        return [
            replace(r, pieces=[replace(p, name=self.saved_name(p.name)) for p in r.pieces if self.writes(p.name)])
            for r in records
        ]

    def for_loading(self, records: list[ShardRecord]) -> list[ShardRecord]:
        """The stage's records with every piece under the name its values were saved under."""
        return [replace(r, pieces=[replace(p, name=self.saved_name(p.name)) for p in r.pieces]) for r in records]

    def spec_row(self, aliases: Mapping[str, str]) -> SpecRow:
        """This rank's row of the manifest's tensor_parallel section (tied names are saved once)."""
        return self.tp_rank, {
            name: [s.dim, s.stride, list(s.shape)] for name, s in self.sliced.items() if name not in aliases
        }


# ------------------------------------------------------------------------------------- manifest
def manifest_section(tp_size: int, dp_size: int, rows: Sequence[SpecRow]) -> dict[str, Any]:
    """The manifest's `tensor_parallel` section from every rank's spec row: the sizes and, per
    tensor-parallel tensor, its partition_dim, partition_stride, whole shape, each rank's slice shape
    and the names the slices were saved under. Every rank computes it (from the same rows), so a
    refusal is raised everywhere."""
    by_rank: dict[int, dict[str, list[Any]]] = {}
    for tp_rank, specs in rows:
        by_rank.setdefault(tp_rank, specs)
    names = list(dict.fromkeys(name for r in sorted(by_rank) for name in by_rank[r]))
    params: dict[str, Any] = {}
    for name in names:
        held = [by_rank.get(r, {}).get(name) for r in range(tp_size)]
        dim, stride = (held[0] or [0, 1])[:2]
        if any(h is None or h[:2] != [dim, stride] for h in held):
            raise CheckpointError(
                f"save_checkpoint: {name!r} is not split the same way on every tensor-parallel "
                f"rank ([partition_dim, partition_stride, slice shape] per rank: {held}); the "
                "ranks must hold slices of the same model"
            )
        slices = [list(h[2]) for h in held if h is not None]
        params[name] = {
            "partition_dim": dim,
            "partition_stride": stride,
            "shape": joined_shape(slices, dim),
            "slice_shapes": slices,
            "saved_as": [slice_name(name, r) for r in range(tp_size)],
        }
    return {"tp_size": tp_size, "dp_size": dp_size, "params": params}


# ----------------------------------------------------------------------------------------- load
def reader_for(reader: PieceReader, names: CheckpointNames, module: torch.nn.Module) -> PieceReader:
    """The reader this rank loads through: `reader` itself where each slice is this rank's as saved, a
    RecutReader otherwise (another tensor-parallel size, or tensors split otherwise). A model that does
    not match (another whole shape) is refused by name before anything is read."""
    if _same_layout(reader, names, module):
        return reader
    recuts = plan_recuts(
        reader,
        {name: (spec.dim, spec.stride) for name, spec in names.sliced.items()},
        names.tp_rank,
        names.tp_size,
        names.whole_shapes(module),
        names.saved_name,
    )
    return RecutReader(reader, recuts)


def _same_layout(reader: PieceReader, names: CheckpointNames, module: torch.nn.Module) -> bool:
    """Whether every tensor is split here exactly as it was saved (same size, same tensors split, same
    partition_dim, stride and slice shape): then each rank reads its own slices' saved pieces."""
    saved = tp_section(reader.manifest)
    if saved["tp_size"] != names.tp_size:
        return False
    if names.tp_size == 1:
        return True
    aliases = reader.manifest.get("aliases", {})
    for name, spec in names.sliced.items():
        entry = saved["params"].get(aliases.get(name, name))
        if entry is None:
            if reader.has(name, "model") or reader.has(name, "optim"):
                return False  # saved replicated, sliced here
            continue  # not in the checkpoint at all: load_module_strict decides
        here = [spec.dim, spec.stride, list(spec.shape)]
        if here != [entry["partition_dim"], entry["partition_stride"], entry["slice_shapes"][names.tp_rank]]:
            return False
        if entry.get("rows_kept") is not None or entry.get("partition_sections") is not None:
            return False
    live = set(module.state_dict(keep_vars=True))
    return not any(name in live and name not in names.sliced for name in saved["params"])


# ---------------------------------------------------------------------------------- consolidate
def slice_sources(manifest: Mapping[str, Any]) -> dict[str, str]:
    """Saved slice name -> the tensor it is a slice of."""
    return {saved: name for name, entry in tp_section(manifest)["params"].items() for saved in entry["saved_as"]}
