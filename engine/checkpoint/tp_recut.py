"""Loading a checkpoint at another tensor-parallel size: each slice re-cut from the whole tensor.

A checkpoint saved at tensor-parallel size t holds, per tensor-parallel tensor, t slices under their
saved names (engine/checkpoint/tensor_parallel.py); one saved without tensor parallelism holds the
whole tensor under its own name. A run at size t' asks the reader for the names it would have saved
(`CheckpointNames.saved_name`: its own slice's name, or the plain name at t' = 1). `RecutReader`
answers those: it joins the saved slices into the whole tensor (join_slices, with the saved
partition_dim and partition_stride, so a fused qkv's chunks go back where they were), cuts this
rank's slice out of it (split_slice, with the live model's attributes) and serves element ranges of
that slice, for the fp32 master and every optimizer state key alike: Adam's moments are elementwise,
so re-cutting them as the weights are is exact. Every other name goes to the reader underneath
unchanged, so data-parallel resharding and stage changes work as before.

One tensor is assembled at a time (its keys together: a record reads a piece's master and moments
in turn), so the extra memory is a few copies of the largest tensor-parallel tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.checkpoint.files import CheckpointError, tp_section
from engine.checkpoint.piece_reader import PieceReader
from engine.zero.tp_state import join_slices, split_slice


@dataclass(frozen=True)
class Recut:
    """How one tensor's values are found: the saved parts and how to join them, and how to cut this
    rank's slice."""

    name: str
    """The parameter's name in the checkpoint (its state-dict name)."""
    saved_parts: list[str]
    """The names its values were saved under: t slices in rank order, or [name] when saved whole."""
    saved_shapes: list[tuple[int, ...]]
    saved_dim: int
    saved_stride: int
    whole_shape: tuple[int, ...]
    rows_kept: int | None
    """Keep only the first rows of the joined tensor (the rest: a vocabulary's padding, DeepSpeed's)."""
    saved_sections: tuple[int, ...] | None
    """The whole sizes of unequal parts the slices hold their shares of (join_slices' `sections`)."""
    cut: tuple[int, int, int, int] | None
    """(tp_rank, tp_size, partition_dim, partition_stride) of this rank's slice; None: the whole tensor."""


class RecutReader(PieceReader):
    """A PieceReader whose tensor-parallel tensors are re-cut for this run's tensor-parallel size."""

    def __init__(self, base: PieceReader, recuts: Mapping[str, Recut]) -> None:
        # Shares the base reader's files and index: only the requested names below are served otherwise.
        self.tag_dir, self.manifest, self.where = base.tag_dir, base.manifest, base.where
        self._base = base
        self._recuts = dict(recuts)
        """Requested name (this run's saved name of a slice, or a plain name) -> how to serve it."""
        self._held: tuple[str, dict[tuple[str, str, torch.dtype], torch.Tensor]] = ("", {})
        """The one tensor assembled now: requested name -> (kind, key, dtype) -> this rank's slice, flat."""

    def file(self, name: str) -> dict[str, Any]:
        return self._base.file(name)

    def entry(self, fname: str, name: str, offset: int) -> dict[str, Any]:
        return self._base.entry(fname, name, offset)

    def whole(self, name: str, rank: int) -> torch.Tensor:
        return self._base.whole(name, rank)

    def has(self, name: str, kind: str) -> bool:
        recut = self._recuts.get(name)
        if recut is None:
            return self._base.has(name, kind)
        return all(self._base.has(part, kind) for part in recut.saved_parts)

    def state_keys(self, name: str) -> list[str]:
        recut = self._recuts.get(name)
        return self._base.state_keys(recut.saved_parts[0] if recut is not None else name)

    def read(self, name: str, kind: str, key: str, lo: int, numel: int, out: torch.Tensor) -> None:
        recut = self._recuts.get(name)
        if recut is None:
            self._base.read(name, kind, key, lo, numel, out)
            return
        mine = self._slice(name, recut, kind, key, out.dtype)
        if lo + numel > mine.numel():
            raise CheckpointError(
                f"checkpoint {self.tag_dir}: elements [{lo}, {lo + numel}) of {key!r} of {recut.name!r} asked "
                f"for, this rank's slice of it has {mine.numel()}; it was saved from a different model"
            )
        out.copy_(mine[lo : lo + numel])

    def _slice(self, name: str, recut: Recut, kind: str, key: str, dtype: torch.dtype) -> torch.Tensor:
        held_name, held = self._held
        if held_name != name:
            held = {}
            self._held = (name, held)
        if (kind, key, dtype) not in held:
            parts = []
            for part, shape in zip(recut.saved_parts, recut.saved_shapes):
                flat = torch.empty(_numel(shape), dtype=dtype)
                self._base.read(part, kind, key, 0, flat.numel(), flat)
                parts.append(flat.view(shape))
            whole = (
                parts[0]
                if len(parts) == 1
                else join_slices(parts, recut.saved_dim, recut.saved_stride, recut.saved_sections)
            )
            if recut.rows_kept is not None:
                whole = whole.narrow(0, 0, recut.rows_kept)
            if recut.cut is not None:
                rank, size, dim, stride = recut.cut
                whole = split_slice(whole, rank, size, dim, stride)
            held[(kind, key, dtype)] = whole.contiguous().reshape(-1)
        return held[(kind, key, dtype)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_recuts(
    reader: PieceReader,
    sliced_here: Mapping[str, tuple[int, int]],
    tp_rank: int,
    tp_size: int,
    whole_shapes: Mapping[str, tuple[int, ...]],
    saved_name: Callable[[str], str],
) -> dict[str, Recut]:
    """What this rank reads re-cut, by the name it asks for (`saved_name(name)`: this run's name for its
    slice of `name`). `sliced_here`: name -> (partition_dim, partition_stride) of this run's
    tensor-parallel tensors; `whole_shapes`: every tensor's whole shape here. Joined as saved and cut
    as here, a tensor may be split along another dimension or stride; another whole shape is refused
    by name."""
    saved = tp_section(reader.manifest)
    saved_params: Mapping[str, Any] = saved["params"]
    aliases = reader.manifest.get("aliases", {})
    recuts: dict[str, Recut] = {}
    for name in set(sliced_here) | {n for n in whole_shapes if aliases.get(n, n) in saved_params}:
        source = aliases.get(name, name)
        entry = saved_params.get(source)
        here = sliced_here.get(name)
        if entry is not None:
            parts = list(entry["saved_as"])
            shapes = [tuple(s) for s in entry["slice_shapes"]]
            dim, stride, whole = int(entry["partition_dim"]), int(entry["partition_stride"]), tuple(entry["shape"])
            rows_kept = entry.get("rows_kept")
            sections = tuple(entry["partition_sections"]) if entry.get("partition_sections") else None
            if rows_kept is not None:
                whole = (int(rows_kept), *whole[1:])
        else:
            if not (reader.has(source, "model") or reader.has(source, "optim")):
                continue  # not in the checkpoint: load_module_strict decides
            whole = tuple(reader.manifest["params"][source]["shape"])
            parts, shapes, rows_kept, sections = [source], [whole], None, None
            dim, stride = (here[0], here[1]) if here is not None else (0, 1)
        if whole != tuple(whole_shapes[name]):
            raise CheckpointError(
                f"checkpoint {reader.tag_dir}: {name!r} has the whole shape {list(whole)} there (joined over "
                f"its {saved['tp_size']} tensor-parallel slices) and {list(whole_shapes[name])} here; build the "
                "model as it was saved"
            )
        cut = (tp_rank, tp_size, here[0], here[1]) if here is not None else None
        if here is not None and whole[here[0]] % (tp_size * here[1]):
            raise CheckpointError(
                f"{name!r}: dimension {here[0]} of its whole shape {list(whole)} does not divide into "
                f"{tp_size} tensor-parallel slices of {here[1]} chunks; choose a tensor-parallel size that divides it"
            )
        recuts[saved_name(name)] = Recut(source, parts, shapes, dim, stride, whole, rows_kept, sections, cut)
    return recuts
