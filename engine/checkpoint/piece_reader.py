"""Reading any element range of a parameter's saved values from a checkpoint's rank files.

The manifest lists, for each rank, the pieces (kind, parameter name, offset, numel) its files hold; a
read gathers the requested range from every piece that overlaps it. Files are loaded lazily, once,
memory-mapped (engine/checkpoint/files.py), so a reader holds no more than the files it has touched.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.checkpoint.files import MANIFEST, CheckpointError, load_file, model_file, optim_file


class PieceReader:
    """Reads any element range of a named parameter's saved values, from whichever files hold it."""

    def __init__(self, tag_dir: str, manifest: dict[str, Any]) -> None:
        self.tag_dir = tag_dir
        self.manifest = manifest
        # name -> kind -> [(offset, numel, rank)]
        self.where: dict[str, dict[str, list[tuple[int, int, int]]]] = {}
        for r, entries in enumerate(manifest["pieces"]):
            for kind, name, offset, numel in entries:
                self.where.setdefault(name, {}).setdefault(kind, []).append((offset, numel, r))
        self._files: dict[str, dict[str, Any]] = {}

    def file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            expected = self.manifest.get("checksums", {}).get(name)
            self._files[name] = load_file(os.path.join(self.tag_dir, name), expected)
        return self._files[name]

    def entry(self, fname: str, name: str, offset: int) -> dict[str, Any]:
        """The piece of parameter `name` at `offset` that the manifest says file `fname` holds."""
        pieces = self.file(fname).get("pieces")
        entries = pieces.get(name) if isinstance(pieces, dict) else None
        entry = next((e for e in entries or [] if isinstance(e, dict) and e.get("offset") == offset), None)
        if entry is None:
            raise CheckpointError(
                f"{os.path.join(self.tag_dir, fname)} lacks the piece of parameter {name!r} at offset "
                f"{offset} that {os.path.join(self.tag_dir, MANIFEST)} lists; the checkpoint is "
                "corrupted; load another tag"
            )
        return entry

    def whole(self, name: str, rank: int) -> torch.Tensor:
        """A tensor saved whole (a buffer, a frozen parameter at stages 0-2) in `rank`'s model file."""
        tensor = self.file(model_file(rank)).get("whole", {}).get(name)
        if not torch.is_tensor(tensor):
            raise CheckpointError(
                f"{os.path.join(self.tag_dir, MANIFEST)}: key pieces.{rank} lists {name!r}, which is "
                f"neither in params nor saved whole in {model_file(rank)}; the manifest was edited "
                "or is corrupted; load another tag"
            )
        return tensor

    def state_keys(self, name: str) -> list[str]:
        """Optimizer state keys saved with a trainable parameter's pieces (exp_avg, exp_avg_sq, ...)."""
        offset, _, rank = self.where[name]["optim"][0] if "optim" in self.where.get(name, {}) else (0, 0, -1)
        if rank < 0:
            return []
        return [k for k in self.entry(optim_file(rank), name, offset) if k not in ("offset", "master")]

    def has(self, name: str, kind: str) -> bool:
        return kind in self.where.get(name, {})

    def read(self, name: str, kind: str, key: str, lo: int, numel: int, out: torch.Tensor) -> None:
        """out (1-D, numel elements) <- elements [lo, lo + numel) of `key` of parameter `name`."""
        covered = 0
        for offset, n, rank in self.where.get(name, {}).get(kind, []):
            a, b = max(lo, offset), min(lo + numel, offset + n)
            if a >= b:
                continue
            fname = model_file(rank) if kind == "model" else optim_file(rank)
            data = self.file(fname)
            if kind == "model" and name in data.get("whole", {}):
                src = data["whole"][name].reshape(-1)
                base = 0
            else:
                entry = self.entry(fname, name, offset)
                if not torch.is_tensor(entry.get(key)):
                    raise CheckpointError(
                        f"{os.path.join(self.tag_dir, fname)} lacks {key!r} of parameter {name!r} "
                        f"at offset {offset} that its manifest lists; the checkpoint is corrupted"
                    )
                src, base = entry[key].reshape(-1), offset
            if src.numel() < b - base:
                raise CheckpointError(
                    f"{os.path.join(self.tag_dir, fname)}: {key!r} of {name!r} holds {src.numel()} "
                    f"elements, the manifest says more; the checkpoint is corrupted"
                )
            out[a - lo : b - lo].copy_(src[a - base : b - base])
            covered += b - a
        if covered != numel:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} has {covered} of elements [{lo}, {lo + numel}) of "
                f"{key!r} of parameter {name!r}; it was saved from a different model"
            )
