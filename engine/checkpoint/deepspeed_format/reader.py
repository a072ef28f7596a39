"""A PieceReader over a DeepSpeed checkpoint: the engine's load path, unchanged, reads DeepSpeed's files.

convert() (layout.py) describes DeepSpeed's files as the engine's pieces; this reader presents them
under the engine's file names and a manifest built from them, so engine/checkpoint/store.py's load
fills any world size and stage from them exactly as from the engine's own checkpoints.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.checkpoint.deepspeed_format.layout import (
    Converted,
    convert,
    is_deepspeed_tag_dir,
    model_states_name,
    mp_world_size,
)
from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file
from engine.checkpoint.deepspeed_format.tensor_parallel import merge_tensor_parallel
from engine.checkpoint.files import CheckpointError, model_file, optim_file, read_manifest
from engine.checkpoint.piece_reader import PieceReader
from engine.zero.partitioned_init import full_shape


class DeepSpeedReader(PieceReader):
    """Reads a DeepSpeed tag directory's values by parameter name and offset, as PieceReader does the
    engine's. All files are read when it is built (memory-mapped: pieces are views into them)."""

    def __init__(self, tag_dir: str, model_shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """`model_shapes`: the model's whole parameter shapes, by name; they say how a tensor-parallel
        checkpoint without an affine_map (DeepSpeed < 0.18) was split."""
        stage3 = os.path.isfile(os.path.join(tag_dir, model_states_name(0)))
        head = load_deepspeed_file(os.path.join(tag_dir, model_states_name(0 if stage3 else None)))
        mp = _declared_mp(head, tag_dir, stage3)
        tp: dict[str, Any] | None = None
        if mp > 1:  # one conversion per tensor-parallel rank, merged under the engine's slice names
            parts = [convert(tag_dir, m) for m in range(mp)]
            saved_shapes = None
            if model_shapes is not None:  # under the checkpoint's names (a tied parameter's alias)
                saved_shapes = {parts[0].aliases.get(n, n): s for n, s in model_shapes.items()}
            self.converted, tp = merge_tensor_parallel(parts, head, tag_dir, saved_shapes)
        else:
            self.converted = convert(tag_dir)
        super().__init__(tag_dir, _manifest(self.converted, tp))
        self._files = _files(self.converted)

    def file(self, name: str) -> dict[str, Any]:
        return self._files[name]

    def check_model(self, module: torch.nn.Module, whole_shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Refuse a checkpoint of another model before anything is read: the first parameter whose
        shape differs is named with both shapes. `whole_shapes`: the live parameters' whole shapes
        (their tensor-parallel slices joined); by default their own."""
        saved = self.converted.params
        for name, p in module.named_parameters():
            here = (
                list(whole_shapes[name]) if whole_shapes is not None and name in whole_shapes else list(full_shape(p))
            )
            there = saved.get(self.converted.aliases.get(name, name))
            if there is not None and there != here:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.tag_dir} is of another model: parameter {name!r} "
                    f"has shape {there} there and {here} here; load it into the model it was "
                    "saved from"
                )


def _declared_mp(head: dict[str, Any], tag_dir: str, stage3: bool) -> int:
    """The tensor-parallel size DeepSpeed says it saved at; every rank's model-states file must be there."""
    declared = head.get("mp_world_size", 1)
    mp = int(declared) if isinstance(declared, int) else 1
    found = mp_world_size(tag_dir)
    if found != mp:
        missing = model_states_name(0 if stage3 else None, found)
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed saved this checkpoint at tensor-parallel size {mp} (mp_world_size) but "
            f"{os.path.join(tag_dir, missing)} is {'missing' if found < mp else 'there too'}; each "
            "tensor-parallel rank wrote its own files: copy the whole tag directory"
        )
    return mp


def open_reader(
    tag_dir: str, module: torch.nn.Module, whole_shapes: Mapping[str, tuple[int, ...]] | None = None
) -> PieceReader:
    """The reader for a tag directory: DeepSpeed's layout through DeepSpeedReader, the engine's own
    through its manifest. `whole_shapes`: as DeepSpeedReader.check_model takes them."""
    if is_deepspeed_tag_dir(tag_dir):
        shapes = {
            name: list(whole_shapes[name]) if whole_shapes is not None and name in whole_shapes else list(full_shape(p))
            for name, p in module.named_parameters()
        }
        reader = DeepSpeedReader(tag_dir, shapes)
        reader.check_model(module, whole_shapes)
        return reader
    return PieceReader(tag_dir, read_manifest(tag_dir))


def _manifest(c: Converted, tp: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest the engine would have written for these pieces (no checksums: DeepSpeed keeps none)."""
    rows: list[list[tuple[str, str, int, int]]] = []
    for r in range(c.world_size):
        row = [("optim", n, e["offset"], int(e["master"].numel())) for n, es in c.optim[r].items() for e in es]
        row += [("model", n, e["offset"], int(e["model"].numel())) for n, es in c.frozen[r].items() for e in es]
        if r == 0:
            row += [("model", n, 0, int(t.numel())) for n, t in c.whole.items()]
        rows.append(row)
    params = {n: {"shape": s, "dtype": "float32", "trainable": n in c.trainable} for n, s in c.params.items()}
    _check_complete(c, rows, tp)
    return {
        "tensor_parallel": tp or {"tp_size": 1, "dp_size": c.world_size, "params": {}},
        "format_version": 1,
        "world_size": c.world_size,
        "stage": c.stage,
        "params": params,
        "pieces": rows,
        "aliases": c.aliases,
        "exclude_frozen_parameters": False,
    }


def _check_complete(c: Converted, rows: list[list[tuple[str, str, int, int]]], tp: dict[str, Any] | None) -> None:
    """Every trainable parameter's pieces add up to its shape, so a damaged file is named here, not as a
    shortfall deep inside loading."""
    held: dict[str, int] = {}
    for row in rows:
        for kind, name, _, numel in row:
            if kind == "optim":
                held[name] = held.get(name, 0) + numel
    sliced = (tp or {}).get("params", {})
    expected: dict[str, list[int]] = {}
    for name in c.trainable:
        if name in sliced:  # each tensor-parallel rank's slice, under its slice name
            expected.update(
                {saved: sliced[name]["slice_shapes"][m] for m, saved in enumerate(sliced[name]["saved_as"])}
            )
        else:
            expected[name] = c.params[name]
    for name in sorted(expected):
        if held.get(name, 0) != math.prod(expected[name]):
            raise CheckpointError(
                f"DeepSpeed checkpoint: the optimizer files hold {held.get(name, 0)} elements of "
                f"parameter {name!r}, its shape {expected[name]} has {math.prod(expected[name])}; "
                "the checkpoint is corrupted or incomplete"
            )


def _files(c: Converted) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for r in range(c.world_size):
        files[model_file(r)] = {"pieces": c.frozen[r], "whole": c.whole if r == 0 else {}}
        files[optim_file(r)] = {"pieces": c.optim[r], "scalars": c.scalars if r == 0 else {}}
    files[model_file(0)].update(c.head)
    return files
