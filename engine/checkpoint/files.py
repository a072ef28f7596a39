"""The checkpoint directory's layout, its manifest, and reading its files with named errors.

    save_dir/latest                      the newest tag (text), written last and atomically
    save_dir/<tag>/manifest.json         format version, world size, stage, dtypes, parameters,
                                         and which pieces of which parameter each rank's files hold
    save_dir/<tag>/rank_<r>_model_states.pt   rank r: frozen-parameter pieces, RNG states; rank 0 also
                                              buffers and whole non-trainable tensors, engine counters,
                                              LR scheduler, loss scaler, client state
    save_dir/<tag>/rank_<r>_optim_states.pt   rank r: fp32 master pieces with their optimizer state

A tag directory appears complete or not at all: every file is written into a hidden
`.<tag>.partial` directory (each file itself atomically), the manifest last, then the directory is
renamed to <tag>. Every file is read with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import torch

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


def read_latest(load_dir: str) -> str:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: no checkpoint was saved with save_latest=True in {load_dir}; "
                              "pass tag= to load_checkpoint (a directory name under it)")
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; pass tag= to load_checkpoint")
    return tag


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
        raise CheckpointError(f"{path} is not readable JSON ({err}); the checkpoint is corrupted") from None
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{path} has no integer format_version; it is not a manifest of this engine")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version}, newer than this engine reads ({FORMAT_VERSION}); "
                              "load it with the engine version that wrote it (manifest engine_version: "
                              f"{manifest.get('engine_version')}) or upgrade")
    return manifest


def load_file(path: str) -> dict[str, Any]:
    """One rank file, memory-mapped (pieces are read on demand), with a named error when it is bad."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        size = os.path.getsize(path)
        raise CheckpointError(f"{path} cannot be read ({size} bytes): {str(err).splitlines()[0]}; the file is "
                              "truncated or corrupted; load an earlier tag") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not this engine's rank state")
    return data
