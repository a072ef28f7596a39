"""The safetensors file format and Hugging Face's sharded layout, written without the safetensors library.

A .safetensors file is an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}} (offsets relative to the end of the
header), then the tensors' raw little-endian bytes, end to end. Every name, dtype and shape is known
from a checkpoint's manifest before any value is read, so the header is written first and each tensor
streamed into its offset afterwards. (safetensors.torch.save_file takes a dict of tensors that are all
in memory at once, which is what consolidating at disk speed must not need.)

Sharded as transformers' save_pretrained writes it: model-00001-of-0000N.safetensors, tensors kept in
order and a shard closed when the next tensor would take it past max_shard_size (a tensor larger than
that gets a shard of its own), and model.safetensors.index.json {"metadata": {"total_size"},
"weight_map": {name: file}}; one shard is plain model.safetensors with no index.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an output file: what its header entry says."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Shard:
    """One output file: its name, its tensors in order, and where each one's bytes start in the file."""

    name: str
    tensors: tuple[TensorSpec, ...]
    header: bytes
    """Everything before the first tensor's bytes: the length prefix and the JSON header."""
    starts: tuple[int, ...]
    """Per tensor, its first byte in the file (header included)."""

    @property
    def size(self) -> int:
        last = self.tensors[-1] if self.tensors else None
        return self.starts[-1] + last.nbytes if last is not None else len(self.header)


def parse_size(value: int | str) -> int:
    """Bytes of a max_shard_size as transformers takes it: an int, or "5GB" (10^9), "500MiB" (2^20)."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", value.upper())
        if match is None:
            raise ValueError(f"max_shard_size {value!r} is not a size: give bytes or e.g. '5GB', '500MiB'")
        size = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if size <= 0:
        raise ValueError(f"max_shard_size {value!r} must be positive")
    return size


def build_shard(name: str, tensors: list[TensorSpec], metadata: dict[str, str] | None = None) -> Shard:
    """The header of a file holding `tensors` end to end, in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in tensors:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {spec.name!r} has dtype {spec.dtype}, which safetensors does not store")
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library writes it
    prefix = struct.pack("<Q", len(encoded)) + encoded
    starts, at = [], len(prefix)
    for spec in tensors:
        starts.append(at)
        at += spec.nbytes
    return Shard(name, tuple(tensors), prefix, tuple(starts))


def split_shards(tensors: list[TensorSpec], max_bytes: int | None) -> list[list[TensorSpec]]:
    """Tensors in order, cut into runs of at most max_bytes each (a larger tensor alone); None: one run."""
    if max_bytes is None:
        return [list(tensors)]
    runs: list[list[TensorSpec]] = [[]]
    held = 0
    for spec in tensors:
        if runs[-1] and held + spec.nbytes > max_bytes:
            runs.append([])
            held = 0
        runs[-1].append(spec)
        held += spec.nbytes
    return runs


def shard_names(count: int) -> list[str]:
    """Hugging Face's file names for `count` shards."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_json(shards: list[Shard]) -> bytes:
    """model.safetensors.index.json for these shards."""
    total = sum(spec.nbytes for shard in shards for spec in shard.tensors)
    weight_map = {spec.name: shard.name for shard in shards for spec in shard.tensors}
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n").encode()
