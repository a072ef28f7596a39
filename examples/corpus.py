"""The training corpus every machine with Python has: the standard library's own source files.

The split is deterministic: a file goes to validation when the CRC32 of its path relative to the
stdlib root is 0 mod 10, so train and validation never share a file and every run (and rank) of
the same Python sees the same bytes.
"""

from __future__ import annotations

import os
import sysconfig
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset


def stdlib_sources(max_bytes: int = 16 << 20) -> tuple[np.ndarray, np.ndarray, int]:
    """(train bytes, validation bytes, number of files) of the stdlib's *.py files, sorted by path,
    excluding site-packages, stopping once max_bytes are read."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not paths:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    train, val, total = [], [], 0
    for path in sorted(paths):
        with open(path, "rb") as f:
            data = f.read()
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        (val if zlib.crc32(rel.encode()) % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8).copy()  # noqa: E731
    return as_array(train), as_array(val), len(train) + len(val)


class ByteWindows(Dataset):
    """`count` windows of seq_len+1 bytes at seeded random offsets: (input, next-byte target)."""

    def __init__(self, data: np.ndarray, seq_len: int, count: int, seed: int) -> None:
        self.data = torch.from_numpy(data)
        self.seq_len = seq_len
        rng = np.random.default_rng(seed)
        self.offsets = rng.integers(0, len(data) - seq_len - 1, size=count)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]
