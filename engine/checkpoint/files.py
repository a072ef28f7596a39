"""The checkpoint directory's layout, its manifest, and reading its files with named errors.

    save_dir/latest                      the newest tag (text), written last and atomically
    save_dir/<tag>/manifest.json         format version, world size, stage, dtypes, parameters,
                                         tensor-parallel sizes and slices (tensor_parallel.py),
                                         and which pieces of which parameter each rank's files hold
    save_dir/<tag>/rank_<r>_model_states.pt   rank r: frozen-parameter pieces, RNG states; rank 0 also
                                              buffers and whole non-trainable tensors (with TP, the
                                              first rank of every data-parallel group: its slices of
                                              them), engine counters, LR scheduler, loss scaler,
                                              client state (its keys also at the top level, where
                                              tools written for DeepSpeed's files read them)
    save_dir/<tag>/rank_<r>_optim_states.pt   rank r: fp32 master pieces with their optimizer state,
                                              and {"optimizer_state_dict": {"zero_stage": N}} (DeepSpeed's
                                              keys, read by Lightning's convert)
With save_checkpoint(exclude_frozen_parameters=True) no frozen parameter's values are written and
the manifest says so.

A tag directory appears complete or not at all: every file is written into a hidden
`.<tag>.partial` directory (each file itself atomically), the manifest last, then the directory is
renamed to <tag>. Every file is read with torch.load(weights_only=True), after its CRC-32 and size
are checked against the manifest's `checksums` (taken while the file was written): flipped or lost
bytes are a CheckpointError naming the file, never silently wrong weights. A CRC detects accidents
(disk, copy, truncation), not tampering; weights_only is what keeps a file from running code.

An optimizer file holds each optimizer state key's pieces as views of one flat tensor (store._pack):
one storage of masters, written first, then one per moment. The manifest's `masters_checksums` then
has, for that file, {"offset", "bytes", "crc32"}: where that storage's bytes lie and the CRC-32 of the
file's first offset + bytes bytes (its pickle and the masters), so consolidate reads and checks only
the bytes its output is made of (a third of the file with Adam); load_checkpoint checks the whole
file. A key of its own, not inside `checksums`, so an engine that predates it loads such checkpoints
as before; checkpoints saved before it are checked whole by both.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema
import torch

from engine.checkpoint.atomic_file import file_crc32

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: names the file and what is wrong with it."""


def model_file(rank: int) -> str:
    return f"rank_{rank}_model_states.pt"


def optim_file(rank: int) -> str:
    return f"rank_{rank}_optim_states.pt"


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def check_tag(tag: str, where: str) -> str:
    """A tag names a directory directly under the checkpoint folder, nothing else."""
    if (
        not tag
        or os.sep in tag
        or (os.altsep and os.altsep in tag)
        or tag in (".", "..")
        or tag.startswith(".")
        or os.path.isabs(tag)
    ):
        raise CheckpointError(
            f"{where}: tag {tag!r} is not a plain directory name inside the checkpoint folder; "
            "a tag may not contain path separators or start with '.'"
        )
    return tag


def read_latest(load_dir: str) -> str:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist: no checkpoint was saved with save_latest=True in {load_dir}; "
            "pass tag= to load_checkpoint (a directory name under it)"
        )
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; pass tag= to load_checkpoint")
    return check_tag(tag, path)


def resolve_tag_dir(load_dir: str, tag: str | None) -> str:
    """The directory to read for `tag` (default: the one `latest` names), as load_checkpoint and
    consolidate both resolve it.

    A save over an existing tag moves the old directory aside (.<tag>.old), renames the new one in,
    then deletes the old: a crash between the two renames leaves only that complete copy, used here.
    """
    tag = check_tag(str(tag), "tag") if tag is not None else read_latest(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    aside = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(tag_dir) and os.path.isdir(aside):
        from engine.monitor.log import get_logger

        get_logger().warning(
            "checkpoint %s is missing but %s is complete (a save replacing it was interrupted); loading that",
            tag_dir,
            aside,
        )
        return aside
    return tag_dir


_PIECE = {
    "type": "array",
    "prefixItems": [
        {"enum": ["model", "optim"]},
        {"type": "string"},
        {"type": "integer", "minimum": 0},
        {"type": "integer", "minimum": 0},
    ],
    "minItems": 4,
    "maxItems": 4,
}
_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_TENSOR_PARALLEL = {
    "type": "object",
    "required": ["tp_size", "dp_size", "params"],
    "properties": {
        "tp_size": {"type": "integer", "minimum": 1},
        "dp_size": {"type": "integer", "minimum": 1},
        "params": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["partition_dim", "partition_stride", "shape", "slice_shapes", "saved_as"],
                "properties": {
                    "partition_dim": {"type": "integer", "minimum": 0},
                    "partition_stride": {"type": "integer", "minimum": 1},
                    "shape": _SHAPE,
                    "slice_shapes": {"type": "array", "items": _SHAPE},
                    "saved_as": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["format_version", "world_size", "stage", "params", "pieces"],
    "properties": {
        "format_version": {"type": "integer"},
        "world_size": {"type": "integer", "minimum": 1},
        "stage": {"type": "integer", "minimum": 0, "maximum": 3},
        "params": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["shape", "dtype"],
                "properties": {"shape": _SHAPE, "dtype": {"type": "string"}, "trainable": {"type": "boolean"}},
            },
        },
        "aliases": {"type": "object", "additionalProperties": {"type": "string"}},
        "tensor_parallel": _TENSOR_PARALLEL,
        "pieces": {"type": "array", "items": {"type": "array", "items": _PIECE}},
        "checksums": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["crc32", "bytes"],
                "properties": {"crc32": {"type": "integer", "minimum": 0}, "bytes": {"type": "integer", "minimum": 0}},
            },
        },
        "masters_checksums": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["offset", "bytes", "crc32"],
                "properties": {
                    "offset": {"type": "integer", "minimum": 0},
                    "bytes": {"type": "integer", "minimum": 0},
                    "crc32": {"type": "integer", "minimum": 0},
                },
            },
        },
    },
}


def read_manifest(tag_dir: str) -> dict[str, Any]:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint directory {tag_dir} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete checkpoint of this engine")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path}: not readable JSON ({err}); the checkpoint is corrupted; load another tag"
        ) from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"{path} has no integer format_version; it is not a manifest of this engine")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {version}, newer than this engine reads ({FORMAT_VERSION}); "
            "load it with the engine version that wrote it (manifest engine_version: "
            f"{manifest.get('engine_version')}) or upgrade"
        )
    # A hand-edited manifest is refused here, by key, not with a KeyError deep inside loading.
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_MANIFEST_SCHEMA).iter_errors(manifest))
    if error is not None:
        _edited(path, ".".join(str(p) for p in error.absolute_path) or "(top level)", error.message)
    _check_agreement(manifest, path)
    return manifest


def _edited(path: str, key: str, what: str) -> None:
    raise CheckpointError(
        f"{path}: key {key}: {what}; the manifest was edited or is corrupted (this engine writes it "
        "itself); load another tag"
    )


def _check_agreement(manifest: dict[str, Any], path: str) -> None:
    """What the schema cannot say: the keys agree with each other, so that nothing later fails with a
    KeyError, a shape error, or (consolidating to safetensors) a header that does not fit its data."""
    world = manifest["world_size"]
    if len(manifest["pieces"]) != world:
        _edited(path, "pieces", f"lists {len(manifest['pieces'])} ranks but world_size is {world}")
    held: dict[str, dict[str, int]] = {}  # name -> kind -> elements listed
    for entries in manifest["pieces"]:
        for kind, name, _, numel in entries:
            held.setdefault(name, {}).setdefault(kind, 0)
            held[name][kind] += numel
    for name, spec in manifest["params"].items():
        kinds = held.get(name)
        if kinds is not None:  # what load and consolidate read: the fp32 masters of a trainable parameter
            listed = kinds["optim" if "optim" in kinds else "model"]
            if listed != math.prod(spec["shape"]):
                _edited(
                    path,
                    f"params.{name}.shape",
                    f"{spec['shape']} holds {math.prod(spec['shape'])} elements "
                    f"but the pieces listed for {name!r} hold {listed}",
                )
    _check_slices(manifest, path, {name: kinds.get("optim", kinds.get("model", 0)) for name, kinds in held.items()})
    for alias, target in manifest.get("aliases", {}).items():
        if target not in manifest["params"]:
            _edited(path, f"aliases.{alias}", f"names {target!r}, which is not in params")
    if "checksums" in manifest:  # one entry removed would leave that file unchecked
        missing = sorted(
            {name for r in range(world) for name in (model_file(r), optim_file(r))} - set(manifest["checksums"])
        )
        if missing:
            _edited(path, "checksums", f"has no entry for {', '.join(missing)}")
    for name, masters in manifest.get("masters_checksums", {}).items() if "checksums" in manifest else ():
        whole = manifest["checksums"].get(name)
        if whole is None or masters["offset"] + masters["bytes"] > whole["bytes"]:
            what = "has no checksums entry" if whole is None else f"ends past the file's {whole['bytes']} bytes"
            _edited(path, f"masters_checksums.{name}", what)


def tp_section(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's tensor_parallel section (engine/checkpoint/tensor_parallel.py); a manifest
    without one was saved without tensor parallelism."""
    found = manifest.get("tensor_parallel")
    if isinstance(found, dict):
        return found
    return {"tp_size": 1, "dp_size": manifest["world_size"], "params": {}}


def joined_shape(slices: list[list[int]], dim: int) -> list[int]:
    """A tensor-parallel tensor's whole shape from its slices' (engine/zero/tp_state.py join_slices
    concatenates along `dim`, whatever the stride)."""
    shape = list(slices[0])
    shape[dim] = sum(s[dim] for s in slices)
    return shape


def _check_slices(manifest: dict[str, Any], path: str, held: dict[str, int]) -> None:
    """The tensor_parallel section agrees with the world size and with the pieces listed for each
    slice (`held`: elements listed per saved name)."""
    tp = tp_section(manifest)
    if tp["tp_size"] * tp["dp_size"] != manifest["world_size"]:
        _edited(
            path,
            "tensor_parallel",
            f"tp_size {tp['tp_size']} x dp_size {tp['dp_size']} is not world_size {manifest['world_size']}",
        )
    for name, entry in tp["params"].items():
        key, slices, shape = f"tensor_parallel.params.{name}", entry["slice_shapes"], entry["shape"]
        if len(slices) != tp["tp_size"] or len(entry["saved_as"]) != tp["tp_size"]:
            _edited(
                path,
                key,
                f"has {len(slices)} slice shapes and {len(entry['saved_as'])} names for tp_size {tp['tp_size']}",
            )
        if (
            entry["partition_dim"] >= len(shape)
            or any(len(s) != len(shape) for s in slices)
            or joined_shape(slices, entry["partition_dim"]) != shape
        ):
            _edited(path, key, f"slices {slices} joined along dim {entry['partition_dim']} are not shape {shape}")
        for saved, piece_shape in zip(entry["saved_as"], slices):
            if held.get(saved, math.prod(piece_shape)) != math.prod(piece_shape):
                _edited(
                    path,
                    key,
                    f"slice shape {piece_shape} holds {math.prod(piece_shape)} elements but the "
                    f"pieces listed for {saved!r} hold {held[saved]}",
                )


def unpickling_reason(err: Exception) -> str:
    """The line of torch's weights_only message that names the refused global (torch 2.13 words it
    "Trying to load unsupported GLOBAL posix.system ...", older ones "Unsupported global: ..."), not the
    preamble about torch.load's default."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "global" in line.lower() or "WeightsUnpickler error" in line]
    return (named or lines or [type(err).__name__])[0]


def check_checksum(path: str, found: dict[str, int], expected: dict[str, int]) -> None:
    """A rank file's {"crc32", "bytes"} as read against the manifest's: a named error when they differ
    (consolidate passes the CRC-32 of the file's first "bytes" bytes, as read, and masters_checksums')."""
    if (found["crc32"], found["bytes"]) != (expected["crc32"], expected["bytes"]):
        what = (
            f"{found['bytes']} bytes, the manifest says {expected['bytes']}"
            if found["bytes"] != expected["bytes"]
            else f"CRC-32 {found['crc32']:08x}, the manifest says {expected['crc32']:08x}"
        )
        raise CheckpointError(
            f"{path} was modified or damaged after it was saved ({what}); its values cannot be "
            "trusted: load an earlier tag"
        )


def load_file(path: str, expected: dict[str, int] | None = None) -> dict[str, Any]:
    """One rank file, memory-mapped (pieces are read on demand), with a named error when it is bad.
    `expected` is the manifest's {"crc32", "bytes"} for it (None: a checkpoint saved before checksums)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    if expected is not None:
        check_checksum(path, file_crc32(path), expected)
    return load_dict(
        path,
        refused=lambda reason: (
            f"that torch.load(weights_only=True) refuses ({reason}); checkpoints written by this engine "
            "check client_state when saving, so this file was written elsewhere or by an older version. If "
            "you trust it, read it with torch.load(weights_only=False) and save it again"
        ),
        holds="this engine's rank state",
        retry="load an earlier tag",
    )


def load_dict(path: str, *, refused: Callable[[str], str], holds: str, retry: str) -> dict[str, Any]:
    """torch.load(path, weights_only=True), memory-mapped, its failures CheckpointErrors naming the file:
    a refused global ("{path} holds an object " + refused(the global torch names)), a truncated or
    corrupted file (ending in `retry`), or anything but a dict (not `holds`)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} holds an object {refused(unpickling_reason(err))}") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        size = os.path.getsize(path)
        raise CheckpointError(
            f"{path} cannot be read ({size} bytes): {str(err).splitlines()[0]}; the file is "
            f"truncated or corrupted; {retry}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not {holds}")
    return data
