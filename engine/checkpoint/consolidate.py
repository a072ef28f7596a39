"""One state dict from a sharded checkpoint, the engine's or DeepSpeed's, for `model.load_state_dict`:

    python -m engine.checkpoint.consolidate CKPT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16]
                                            [--max-shard-size 5GB] [--workers N]

CKPT_DIR is a save_checkpoint directory of this engine or of DeepSpeed (global_stepN/ with DeepSpeed's
zero_pp_rank files: read as they are, no converter), its `latest` tag unless --tag; or a tag directory
itself. Trainable parameters come from the fp32 masters, frozen ones and buffers as saved; a
tensor-parallel parameter is its slices joined along the partition_dim and stride the manifest records
(engine/zero/tp_state.py), so the output is the dense model's state dict whatever the parallel sizes.

OUT ending in .safetensors: one safetensors file. OUT an existing directory, a name ending in "/", or
any OUT with --max-shard-size: transformers' layout there (model.safetensors, or
model-00001-of-0000N.safetensors shards and model.safetensors.index.json), loadable with
`from_pretrained` beside the model's config.json. Both are streamed at disk speed: the values go from
the rank files to the output by --workers processes (default: up to 4, one per core), never all in
memory (consolidate_stream.py); --no-verify skips the CRC-32 check of the engine's rank files, which
reads every byte of them. Any other OUT is written with torch.save, which needs the whole dict in
memory. Every output appears complete or not at all.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

from engine.checkpoint.atomic_file import atomic_save
from engine.checkpoint.consolidate_plan import assemble, open_checkpoint, plan, tag_dir_of
from engine.checkpoint.consolidate_stream import write_dir, write_file
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.safetensors_writer import SAFETENSORS_DTYPES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["DTYPES", "SAFETENSORS_DTYPES", "consolidate", "main", "write_safetensors", "write_safetensors_dir"]


def consolidate(
    ckpt_dir: str, tag: str | None = None, dtype: torch.dtype = torch.float32, progress: bool = False
) -> dict[str, torch.Tensor]:
    """The whole state dict in memory (for torch.save); tied names share one tensor."""
    reader, manifest = open_checkpoint(tag_dir_of(ckpt_dir, tag))
    out: dict[str, torch.Tensor] = {}
    for entry in tqdm(plan(reader, manifest, dtype), desc="consolidating", unit="tensor", disable=not progress):
        out[entry.name] = (
            out[entry.source] if entry.source in out else assemble(reader, entry).view(entry.shape).to(entry.dtype)
        )
    return out


def write_safetensors(
    ckpt_dir: str,
    out: str,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    workers: int | None = None,
    verify: bool = True,
) -> int:
    """The consolidated state dict streamed into one .safetensors file at `out`; returns the bytes of
    tensor data written. verify=False: the engine's rank files' CRC-32s are not checked."""
    return write_file(tag_dir_of(ckpt_dir, tag), out, dtype, workers, progress, verify)


def write_safetensors_dir(
    ckpt_dir: str,
    out_dir: str,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    progress: bool = False,
    workers: int | None = None,
    verify: bool = True,
) -> list[str]:
    """The consolidated state dict streamed into out_dir as transformers lays it out (shards of at most
    max_shard_size and an index when it needs more than one); returns the file names written."""
    return write_dir(tag_dir_of(ckpt_dir, tag), out_dir, dtype, max_shard_size, workers, progress, verify)


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
    parser.add_argument("--max-shard-size", default=None, help="e.g. 5GB (10^9 bytes), 500MiB; OUT is a directory")
    parser.add_argument("--workers", type=int, default=None, help="copying processes (default: up to 4)")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="safetensors outputs: skip the CRC-32 check of the engine's rank files (it reads every byte of them)",
    )
    args = parser.parse_args(argv)
    dtype, verify = DTYPES[args.dtype], not args.no_verify
    as_dir = args.max_shard_size is not None or os.path.isdir(args.out) or args.out.endswith(("/", os.sep))
    try:
        if as_dir:
            names = write_safetensors_dir(
                args.ckpt_dir, args.out, args.tag, dtype, args.max_shard_size or "5GB", True, args.workers, verify
            )
            total = sum(os.path.getsize(os.path.join(args.out, n)) for n in names)
        elif args.out.endswith(".safetensors"):
            total = write_safetensors(args.ckpt_dir, args.out, args.tag, dtype, True, args.workers, verify)
        else:  # torch.save needs the whole dict
            state = consolidate(args.ckpt_dir, args.tag, dtype, progress=True)
            atomic_save(state, args.out)
            total = sum(v.numel() * v.element_size() for v in state.values())
    except (CheckpointError, ValueError) as err:
        print(f"consolidate: {err}", file=sys.stderr)
        return 1
    print(f"consolidate: {total / 2**20:.1f} MiB ({args.dtype}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
