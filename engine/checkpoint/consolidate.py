"""One state dict from a sharded checkpoint, for `model.load_state_dict`:

    python -m engine.checkpoint.consolidate CKPT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]

CKPT_DIR is a save_checkpoint directory (its `latest` tag unless --tag). Trainable parameters come
from the fp32 masters, frozen ones and buffers as saved. Every rank file is memory-mapped and each
parameter assembled from its pieces in turn; a tensor-parallel one from each tensor-parallel rank's
slice, joined along the partition_dim and stride the manifest records (engine/zero/tp_state.py), so
the output is the dense model's state dict whatever the tensor-parallel size. OUT ending in .safetensors is streamed (the header from
the manifest, then one tensor at a time: memory holds one parameter, not the model; written here, no
library needed to write it); any other name is written with torch.save, which needs the whole dict in
memory. Atomically either way.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from engine.checkpoint.atomic_file import atomic_open, atomic_save
from engine.checkpoint.files import MANIFEST, CheckpointError, model_file, read_manifest, resolve_tag_dir, tp_section
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.tensor_parallel import slice_sources
from engine.zero.tp_state import join_slices

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidate(
    ckpt_dir: str, tag: str | None = None, dtype: torch.dtype = torch.float32, progress: bool = False
) -> dict[str, torch.Tensor]:
    """The whole state dict in memory (for torch.save); tied names share one tensor."""
    reader, manifest, _ = _open(ckpt_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for entry in tqdm(_plan(reader, manifest, dtype), desc="consolidating", unit="tensor", disable=not progress):
        out[entry.name] = (
            out[entry.source] if entry.source in out else _assemble(reader, entry).view(entry.shape).to(entry.dtype)
        )
    return out


@dataclass(frozen=True)
class _Entry:
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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _open(ckpt_dir: str, tag: str | None) -> tuple[PieceReader, dict, str]:
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    return PieceReader(tag_dir, manifest), manifest, tag_dir


def _assemble(reader: PieceReader, entry: _Entry) -> torch.Tensor:
    """One output tensor's values, flat, in its saved dtype (fp32 for masters): its slices joined."""
    parts = [_read_whole(reader, saved, entry.kind, math.prod(shape)).view(shape) for saved, shape in entry.parts]
    joined = parts[0] if len(parts) == 1 else join_slices(parts, entry.dim, entry.stride)
    return joined.reshape(-1)


def _read_whole(reader: PieceReader, name: str, kind: str, numel: int) -> torch.Tensor:
    """One saved tensor's values, flat, in its saved dtype (fp32 for masters)."""
    saved = torch.float32 if kind == "optim" else _saved_dtype(reader, name, reader.where[name][kind][0])
    flat = torch.empty(numel, dtype=saved)
    reader.read(name, kind, "master" if kind == "optim" else "model", 0, numel, flat)
    return flat


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


def _plan(reader: PieceReader, manifest: dict, dtype: torch.dtype) -> list[_Entry]:
    """Every output tensor, in the order the checkpoint lists them, without reading data."""
    params, sliced, slice_of = manifest["params"], tp_section(manifest)["params"], slice_sources(manifest)
    plan: dict[str, _Entry] = {}
    for name in reader.where:
        if name in slice_of:  # a tensor-parallel slice: its tensor, planned at its first slice
            whole = slice_of[name]
            if whole not in plan:
                entry = sliced[whole]
                parts = tuple(zip(entry["saved_as"], entry["slice_shapes"]))
                kind, saved = _listed(reader, parts)
                plan[whole] = _Entry(
                    whole,
                    whole,
                    kind,
                    _out_dtype(saved, dtype),
                    list(entry["shape"]),
                    parts,
                    entry["partition_dim"],
                    entry["partition_stride"],
                )
            continue
        kinds = reader.where[name]
        kind = "optim" if "optim" in kinds else "model"
        shape = list(params[name]["shape"]) if name in params else list(reader.whole(name, kinds[kind][0][2]).shape)
        kind, saved = _listed(reader, ((name, shape),))
        plan[name] = _Entry(name, name, kind, _out_dtype(saved, dtype), shape, ((name, shape),))
    for alias, target in manifest.get("aliases", {}).items():
        plan[alias] = replace(plan[target], name=alias, source=target)
    return list(plan.values())


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


def write_safetensors(
    ckpt_dir: str, out: str, tag: str | None = None, dtype: torch.dtype = torch.float32, progress: bool = False
) -> int:
    """Stream the consolidated state dict into a .safetensors file: the header comes from the manifest,
    then each tensor is assembled from its pieces and written, so memory holds one tensor at a time.
    Returns the bytes of tensor data written."""
    import json
    import struct

    reader, manifest, tag_dir = _open(ckpt_dir, tag)
    plan = _plan(reader, manifest, dtype)
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": f"{tag_dir}"}}
    offset = 0
    for entry in plan:
        size = entry.numel * entry.dtype.itemsize
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": entry.shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with atomic_open(out) as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for entry in tqdm(plan, desc="consolidating", unit="tensor", disable=not progress):
            flat = _assemble(reader, entry)
            f.write(flat.to(entry.dtype).contiguous().view(torch.uint8).numpy().tobytes())
    return offset


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.checkpoint.consolidate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("ckpt_dir")
    parser.add_argument("out")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    try:
        if args.out.endswith(".safetensors"):  # streamed: one tensor in memory at a time
            total = write_safetensors(args.ckpt_dir, args.out, args.tag, DTYPES[args.dtype], progress=True)
        else:  # torch.save needs the whole dict
            state = consolidate(args.ckpt_dir, args.tag, DTYPES[args.dtype], progress=True)
            atomic_save(state, args.out)
            total = sum(v.numel() * v.element_size() for v in state.values())
    except CheckpointError as err:
        print(f"consolidate: {err}", file=sys.stderr)
        return 1
    print(f"consolidate: {total / 2**20:.1f} MiB ({args.dtype}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
