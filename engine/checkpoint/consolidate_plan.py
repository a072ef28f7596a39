"""What a consolidated state dict holds, planned from a checkpoint's manifest before any value is read.

Either checkpoint is opened here: the engine's own (its manifest and PieceReader) or DeepSpeed's
(global_stepN/ with DeepSpeed's model and optimizer files, no manifest: deepspeed_format's reader,
which presents them as the engine's pieces). The plan lists every output tensor in the checkpoint's
order with its dtype, shape and the saved parts its values come from; consolidate.py assembles them in
memory, consolidate_stream.py copies them straight from the rank files into safetensors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.checkpoint.deepspeed_format import DeepSpeedReader, is_deepspeed_tag_dir
from engine.checkpoint.files import (
    LATEST,
    MANIFEST,
    CheckpointError,
    load_file,
    model_file,
    read_manifest,
    resolve_tag_dir,
    tp_section,
)
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.tensor_parallel import slice_sources
from engine.zero.tp_state import join_slices


@dataclass(frozen=True)
class Entry:
    """One tensor of the output, planned from the manifest without reading data."""

    name: str
    source: str
    """The tensor whose values it takes: itself, or the one a tied name aliases."""
    kind: str
    """Which files hold its values: "optim" (fp32 masters) or "model" (its own dtype)."""
    dtype: torch.dtype
    """In the output."""
    shape: list[int]
    parts: tuple[tuple[str, list[int]], ...]
    """(saved name, shape) of each tensor-parallel rank's slice in rank order; without tensor
    parallelism one part, the tensor itself."""
    dim: int = 0
    stride: int = 1
    """partition_dim and partition_stride, to join the parts."""
    sections: tuple[int, ...] | None = None
    """partition_sections: the whole sizes of unequal parts (join_slices' `sections`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class VerifiedReader(PieceReader):
    """A PieceReader whose files' CRC-32s the caller has already checked (in parallel, before opening)."""

    def file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            self._files[name] = load_file(os.path.join(self.tag_dir, name))
        return self._files[name]


def tag_dir_of(ckpt_dir: str, tag: str | None) -> str:
    """The tag directory to consolidate: ckpt_dir/<tag> (default: what `latest` names), or ckpt_dir
    itself when it is a tag directory (a manifest, or DeepSpeed's files) and has no `latest`."""
    is_tag_dir = os.path.isfile(os.path.join(ckpt_dir, MANIFEST)) or is_deepspeed_tag_dir(ckpt_dir)
    if tag is None and is_tag_dir and not os.path.exists(os.path.join(ckpt_dir, LATEST)):
        return ckpt_dir
    return resolve_tag_dir(ckpt_dir, tag)


def open_checkpoint(tag_dir: str, verified: bool = False) -> tuple[PieceReader, dict[str, Any]]:
    """The reader and manifest of an engine or DeepSpeed tag directory. verified: the engine's files'
    checksums were checked already (each file is then only memory-mapped, not read through)."""
    if is_deepspeed_tag_dir(tag_dir):
        reader = DeepSpeedReader(tag_dir)
        return reader, reader.manifest
    manifest = read_manifest(tag_dir)
    return (VerifiedReader if verified else PieceReader)(tag_dir, manifest), manifest


def assemble(reader: PieceReader, entry: Entry) -> torch.Tensor:
    """One output tensor's values, flat, in its saved dtype (fp32 for masters): its slices joined."""
    parts = [_read_whole(reader, saved, entry.kind, math.prod(shape)).view(shape) for saved, shape in entry.parts]
    joined = parts[0] if len(parts) == 1 else join_slices(parts, entry.dim, entry.stride, entry.sections)
    return joined.reshape(-1)


def _read_whole(reader: PieceReader, name: str, kind: str, numel: int) -> torch.Tensor:
    """One saved tensor's values, flat, in its saved dtype (fp32 for masters)."""
    saved = torch.float32 if kind == "optim" else _saved_dtype(reader, name, reader.where[name][kind][0])
    flat = torch.empty(numel, dtype=saved)
    reader.read(name, kind, "master" if kind == "optim" else "model", 0, numel, flat)
    return flat


def plan(reader: PieceReader, manifest: dict[str, Any], dtype: torch.dtype) -> list[Entry]:
    """Every output tensor, in the order the checkpoint lists them, without reading data."""
    params, sliced, slice_of = manifest["params"], tp_section(manifest)["params"], slice_sources(manifest)
    out: dict[str, Entry] = {}
    for name in reader.where:
        if name in slice_of:  # a tensor-parallel slice: its tensor, planned at its first slice
            whole = slice_of[name]
            if whole not in out:
                entry = sliced[whole]
                parts = tuple(zip(entry["saved_as"], entry["slice_shapes"]))
                kind, saved = _listed(reader, parts)
                out[whole] = Entry(
                    whole,
                    whole,
                    kind,
                    _out_dtype(saved, dtype),
                    list(entry["shape"]),
                    parts,
                    entry["partition_dim"],
                    entry["partition_stride"],
                    tuple(entry["partition_sections"]) if entry.get("partition_sections") else None,
                )
            continue
        kinds = reader.where[name]
        kind = "optim" if "optim" in kinds else "model"
        shape = list(params[name]["shape"]) if name in params else list(reader.whole(name, kinds[kind][0][2]).shape)
        kind, saved = _listed(reader, ((name, shape),))
        out[name] = Entry(name, name, kind, _out_dtype(saved, dtype), shape, ((name, shape),))
    for alias, target in manifest.get("aliases", {}).items():
        if target not in out:
            raise CheckpointError(
                f"{os.path.join(reader.tag_dir, MANIFEST)}: key aliases: {alias!r} names {target!r}, which "
                "the checkpoint does not hold; the manifest was edited or is corrupted; load another tag"
            )
        out[alias] = replace(out[target], name=alias, source=target)
    return list(out.values())


def _listed(reader: PieceReader, parts: tuple[tuple[str, list[int]], ...]) -> tuple[str, torch.dtype]:
    """(kind, saved dtype) of a tensor's saved parts, each checked to be listed whole: a safetensors
    header must fit the data written after it."""
    for saved, shape in parts:
        kinds = reader.where.get(saved, {})
        kind = "optim" if "optim" in kinds else "model"
        numel = sum(n for _, n, _ in kinds.get(kind, []))
        if math.prod(shape) != numel:
            raise CheckpointError(
                f"{os.path.join(reader.tag_dir, MANIFEST)}: key pieces: {saved!r} is listed with "
                f"{numel} elements, its saved shape {shape} holds {math.prod(shape)}; the manifest "
                "was edited or is corrupted; load another tag"
            )
    first, _ = parts[0]
    kind = "optim" if "optim" in reader.where[first] else "model"
    return kind, torch.float32 if kind == "optim" else _saved_dtype(reader, first, reader.where[first][kind][0])


def _out_dtype(saved: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """Floating-point tensors in the requested dtype, others (counters, masks) as saved."""
    return dtype if saved.is_floating_point else saved


def _saved_dtype(reader: PieceReader, name: str, where: tuple[int, int, int]) -> torch.dtype:
    fname = model_file(where[2])
    if name in reader.file(fname).get("whole", {}):
        return reader.whole(name, where[2]).dtype
    saved = reader.entry(fname, name, where[0]).get("model")
    if not torch.is_tensor(saved):
        raise CheckpointError(
            f"{os.path.join(reader.tag_dir, fname)} lacks the values of {name!r} at offset {where[0]} "
            "that its manifest lists; the checkpoint is corrupted; load another tag"
        )
    return saved.dtype
