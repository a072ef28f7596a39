"""One state dict from a sharded checkpoint, for `model.load_state_dict`:

    python -m engine.checkpoint.consolidate CKPT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]

CKPT_DIR is a save_checkpoint directory (its `latest` tag unless --tag). Trainable parameters come
from the fp32 masters, frozen ones and buffers as saved. Every rank file is memory-mapped and each
parameter assembled from its pieces in turn, so reading holds one parameter beyond the output. OUT is
written with safetensors when it is installed and OUT ends in .safetensors, else with torch.save
(atomically either way).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

from engine.atomic_file import atomic_save
from engine.checkpoint.files import CheckpointError, read_latest, read_manifest
from engine.checkpoint.store import PieceReader

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidate(ckpt_dir: str, tag: str | None = None, dtype: torch.dtype = torch.float32,
                progress: bool = False) -> dict[str, torch.Tensor]:
    tag = tag or read_latest(ckpt_dir)
    tag_dir = os.path.join(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    reader = PieceReader(tag_dir, manifest)
    params = manifest["params"]
    out: dict[str, torch.Tensor] = {}
    for name in tqdm(list(reader.where), desc="consolidating", unit="tensor", disable=not progress):
        kinds = reader.where[name]
        kind = "optim" if "optim" in kinds else "model"
        numel = sum(n for _, n, _ in kinds[kind])
        shape = params[name]["shape"] if name in params else None
        first = kinds[kind][0]
        flat = torch.empty(numel, dtype=torch.float32 if kind == "optim" else _saved_dtype(reader, name, first))
        reader.read(name, kind, "master" if kind == "optim" else "model", 0, numel, flat)
        value = flat.view(shape) if shape is not None else _whole_shape(reader, name, first, flat)
        out[name] = value.to(dtype) if value.is_floating_point() else value
    for alias, target in manifest.get("aliases", {}).items():  # tied parameters: the same tensor
        out[alias] = out[target]
    return out


def _saved_dtype(reader: PieceReader, name: str, where: tuple[int, int, int]) -> torch.dtype:
    data = reader.file(f"rank_{where[2]}_model_states.pt")
    if name in data.get("whole", {}):
        return data["whole"][name].dtype
    return next(e for e in data["pieces"][name] if e["offset"] == where[0])["model"].dtype


def _whole_shape(reader: PieceReader, name: str, where: tuple[int, int, int], flat: torch.Tensor) -> torch.Tensor:
    """A buffer (not in the manifest's parameter list) keeps its saved shape."""
    data = reader.file(f"rank_{where[2]}_model_states.pt")
    return flat.view(data["whole"][name].shape) if name in data.get("whole", {}) else flat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir")
    parser.add_argument("out")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    try:
        state = consolidate(args.ckpt_dir, args.tag, DTYPES[args.dtype], progress=True)
    except CheckpointError as err:
        print(f"consolidate: {err}", file=sys.stderr)
        return 1
    if args.out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            print("consolidate: OUT ends in .safetensors but safetensors is not installed (pip install "
                  "safetensors), or name OUT .pt for torch.save", file=sys.stderr)
            return 1
        tmp = f"{args.out}.tmp.{os.getpid()}"
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, args.out)
    else:
        atomic_save(state, args.out)
    total = sum(v.numel() * v.element_size() for v in state.values())
    print(f"consolidate: {len(state)} tensors, {total / 2**20:.1f} MiB ({args.dtype}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
