"""One state dict from a sharded checkpoint, for `model.load_state_dict`:

    python -m engine.checkpoint.consolidate CKPT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]

CKPT_DIR is a save_checkpoint directory (its `latest` tag unless --tag). Trainable parameters come
from the fp32 masters, frozen ones and buffers as saved. Every rank file is memory-mapped and each
parameter assembled from its pieces in turn. OUT ending in .safetensors is streamed (the header from
the manifest, then one tensor at a time: memory holds one parameter, not the model; written here, no
library needed to write it); any other name is written with torch.save, which needs the whole dict in
memory. Atomically either way.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from tqdm import tqdm

from engine.atomic_file import atomic_open, atomic_save
from engine.checkpoint.files import MANIFEST, CheckpointError, model_file, read_manifest, resolve_tag_dir
from engine.checkpoint.piece_reader import PieceReader

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidate(ckpt_dir: str, tag: str | None = None, dtype: torch.dtype = torch.float32,
                progress: bool = False) -> dict[str, torch.Tensor]:
    """The whole state dict in memory (for torch.save); tied names share one tensor."""
    reader, manifest, _ = _open(ckpt_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for name, source, kind, out_dtype, shape, numel in tqdm(_plan(reader, manifest, dtype), desc="consolidating",
                                                            unit="tensor", disable=not progress):
        out[name] = out[source] if source in out else _assemble(reader, source, kind, numel).view(shape).to(out_dtype)
    return out


def _open(ckpt_dir: str, tag: str | None) -> tuple[PieceReader, dict, str]:
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    return PieceReader(tag_dir, manifest), manifest, tag_dir


def _assemble(reader: PieceReader, name: str, kind: str, numel: int) -> torch.Tensor:
    """One tensor's saved values, flat, in its saved dtype (fp32 for masters)."""
    saved = torch.float32 if kind == "optim" else _saved_dtype(reader, name, reader.where[name][kind][0])
    flat = torch.empty(numel, dtype=saved)
    reader.read(name, kind, "master" if kind == "optim" else "model", 0, numel, flat)
    return flat


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _plan(reader: PieceReader, manifest: dict, dtype: torch.dtype) -> list[tuple[str, str, str, torch.dtype,
                                                                                  list[int], int]]:
    """(output name, source name, kind, output dtype, shape, numel) for every tensor, without reading data."""
    params = manifest["params"]
    plan = []
    for name, kinds in reader.where.items():
        kind = "optim" if "optim" in kinds else "model"
        numel = sum(n for _, n, _ in kinds[kind])
        shape = list(params[name]["shape"]) if name in params else list(reader.whole(name, kinds[kind][0][2]).shape)
        saved = torch.float32 if kind == "optim" else _saved_dtype(reader, name, kinds[kind][0])
        if math.prod(shape) != numel:  # a safetensors header must fit the data written after it
            raise CheckpointError(f"{os.path.join(reader.tag_dir, MANIFEST)}: key pieces: {name!r} is listed with "
                                  f"{numel} elements, its saved shape {shape} holds {math.prod(shape)}; the manifest "
                                  "was edited or is corrupted; load another tag")
        plan.append((name, name, kind, dtype if saved.is_floating_point else saved, shape, numel))
    by_name = {p[0]: p for p in plan}
    plan += [(alias, *by_name[target][1:]) for alias, target in manifest.get("aliases", {}).items()]
    return plan


def write_safetensors(ckpt_dir: str, out: str, tag: str | None = None, dtype: torch.dtype = torch.float32,
                      progress: bool = False) -> int:
    """Stream the consolidated state dict into a .safetensors file: the header comes from the manifest,
    then each tensor is assembled from its pieces and written, so memory holds one tensor at a time.
    Returns the bytes of tensor data written."""
    import json
    import struct

    reader, manifest, tag_dir = _open(ckpt_dir, tag)
    plan = _plan(reader, manifest, dtype)
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": f"{tag_dir}"}}
    offset = 0
    for name, _, _, out_dtype, shape, numel in plan:
        size = numel * out_dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with atomic_open(out) as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _name, source, kind, out_dtype, _, numel in tqdm(plan, desc="consolidating", unit="tensor",
                                                             disable=not progress):
            flat = _assemble(reader, source, kind, numel)
            f.write(flat.to(out_dtype).contiguous().view(torch.uint8).numpy().tobytes())
    return offset


def _saved_dtype(reader: PieceReader, name: str, where: tuple[int, int, int]) -> torch.dtype:
    fname = model_file(where[2])
    if name in reader.file(fname).get("whole", {}):
        return reader.whole(name, where[2]).dtype
    saved = reader.entry(fname, name, where[0]).get("model")
    if not torch.is_tensor(saved):
        raise CheckpointError(f"{os.path.join(reader.tag_dir, fname)} lacks the values of {name!r} at offset {where[0]} "
                              "that its manifest lists; the checkpoint is corrupted; load another tag")
    return saved.dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
