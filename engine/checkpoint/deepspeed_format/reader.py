"""A PieceReader over a DeepSpeed checkpoint: the engine's load path, unchanged, reads DeepSpeed's files.

convert() (layout.py) describes DeepSpeed's files as the engine's pieces; this reader presents them
under the engine's file names and a manifest built from them, so engine/checkpoint/store.py's load
fills any world size and stage from them exactly as from the engine's own checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.checkpoint.deepspeed_format.layout import Converted, convert, is_deepspeed_tag_dir
from engine.checkpoint.files import CheckpointError, model_file, optim_file, read_manifest
from engine.checkpoint.piece_reader import PieceReader
from engine.zero.partitioned_init import full_shape


class DeepSpeedReader(PieceReader):
    """Reads a DeepSpeed tag directory's values by parameter name and offset, as PieceReader does the
    engine's. All files are read when it is built (memory-mapped: pieces are views into them)."""

    def __init__(self, tag_dir: str) -> None:
        self.converted = convert(tag_dir)
        super().__init__(tag_dir, _manifest(self.converted))
        self._files = _files(self.converted)

    def file(self, name: str) -> dict[str, Any]:
        return self._files[name]

    def check_model(self, module: torch.nn.Module) -> None:
        """Refuse a checkpoint of another model before anything is read: the first parameter whose
        shape differs is named with both shapes."""
        saved = self.converted.params
        for name, p in module.named_parameters():
            here = list(full_shape(p))
            there = saved.get(self.converted.aliases.get(name, name))
            if there is not None and there != here:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.tag_dir} is of another model: parameter {name!r} "
                    f"has shape {there} there and {here} here; load it into the model it was "
                    "saved from"
                )


def open_reader(tag_dir: str, module: torch.nn.Module) -> PieceReader:
    """The reader for a tag directory: DeepSpeed's layout through DeepSpeedReader, the engine's own
    through its manifest."""
    if is_deepspeed_tag_dir(tag_dir):
        reader = DeepSpeedReader(tag_dir)
        reader.check_model(module)
        return reader
    return PieceReader(tag_dir, read_manifest(tag_dir))


def _manifest(c: Converted) -> dict[str, Any]:
    """The manifest the engine would have written for these pieces (no checksums: DeepSpeed keeps none)."""
    rows: list[list[tuple[str, str, int, int]]] = []
    for r in range(c.world_size):
        row = [("optim", n, e["offset"], int(e["master"].numel())) for n, es in c.optim[r].items() for e in es]
        row += [("model", n, e["offset"], int(e["model"].numel())) for n, es in c.frozen[r].items() for e in es]
        if r == 0:
            row += [("model", n, 0, int(t.numel())) for n, t in c.whole.items()]
        rows.append(row)
    params = {n: {"shape": s, "dtype": "float32", "trainable": n in c.trainable} for n, s in c.params.items()}
    _check_complete(c, rows)
    return {
        "format_version": 1,
        "world_size": c.world_size,
        "stage": c.stage,
        "params": params,
        "pieces": rows,
        "aliases": c.aliases,
        "exclude_frozen_parameters": False,
    }


def _check_complete(c: Converted, rows: list[list[tuple[str, str, int, int]]]) -> None:
    """Every trainable parameter's pieces add up to its shape, so a damaged file is named here, not as a
    shortfall deep inside loading."""
    held: dict[str, int] = {}
    for row in rows:
        for kind, name, _, numel in row:
            if kind == "optim":
                held[name] = held.get(name, 0) + numel
    for name in sorted(c.trainable):
        if held.get(name, 0) != math.prod(c.params[name]):
            raise CheckpointError(
                f"DeepSpeed checkpoint: the optimizer files hold {held.get(name, 0)} elements of "
                f"parameter {name!r}, its shape {c.params[name]} has {math.prod(c.params[name])}; "
                "the checkpoint is corrupted or incomplete"
            )


def _files(c: Converted) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for r in range(c.world_size):
        files[model_file(r)] = {"pieces": c.frozen[r], "whole": c.whole if r == 0 else {}}
        files[optim_file(r)] = {"pieces": c.optim[r], "scalars": c.scalars if r == 0 else {}}
    files[model_file(0)].update(c.head)
    return files
