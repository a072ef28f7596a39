"""What checkpoint integrity costs: the CRC-32 taken while each file is written, and checked before it
is read, against the save and load times of the same checkpoint, in the same run.

    python benchmarks/bench_checkpoint.py --params 25e6      # ~300 MB of fp32 master + Adam state

One process (world size 1, stage 1, fp32 AdamW after one step). Save: median of 3 save_checkpoint
calls; the CRC's share is the time to CRC the written files (what the streaming writer adds).
Load: median of 3 load_checkpoint calls, each verifying every file; the check's share is
file_crc32 over them. Files are in the page cache (just written), as when a job resumes on the
machine that saved. Then the stdlib's candidate hashes over the same files (median of 3 passes), to
show why CRC-32 is the one taken: it detects the accidents it is for (flipped, lost or truncated
bytes) and is the fastest. Results: benchmarks/results/checkpoint.md (and .png with matplotlib).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_facts

import engine
from engine.checkpoint.atomic_file import file_crc32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Zlib:
    """zlib's running checksums behind hashlib's update()."""

    def __init__(self, fn: Callable[[bytes, int], int], start: int) -> None:
        self.fn, self.value = fn, start

    def update(self, data: bytes) -> None:
        self.value = self.fn(data, self.value)


HASHES: dict[str, Callable[[], object]] = {
    "zlib.crc32 (taken)": lambda: _Zlib(zlib.crc32, 0),
    "zlib.adler32": lambda: _Zlib(zlib.adler32, 1),
    "hashlib.blake2b": hashlib.blake2b,
    "hashlib.sha256": hashlib.sha256,
}


def _hash_seconds(files: list[str], make: Callable[[], object], chunk: int = 16 << 20) -> float:
    t0 = time.perf_counter()
    for path in files:
        digest = make()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                digest.update(block)  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=25e6)
    args = parser.parse_args()
    load_before = os.getloadavg()
    width = 2048
    layers = max(1, round(args.params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": None,
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    eng.backward(eng(torch.randn(2, width)).pow(2).mean())
    eng.step()
    with tempfile.TemporaryDirectory() as tmp:
        saves, crcs, loads, checks = [], [], [], []
        for i in range(3):
            t0 = time.perf_counter()
            path = eng.save_checkpoint(tmp, tag=f"t{i}")
            saves.append(time.perf_counter() - t0)
            files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
            t0 = time.perf_counter()
            for f in files:
                file_crc32(f)
            crcs.append(time.perf_counter() - t0)
        size = sum(os.path.getsize(f) for f in files)
        for _ in range(3):
            t0 = time.perf_counter()
            eng.load_checkpoint(tmp)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for f in files:
                file_crc32(f)
            checks.append(time.perf_counter() - t0)
        hashes = {
            name: statistics.median(_hash_seconds(files, make) for _ in range(3)) for name, make in HASHES.items()
        }
    eng.destroy()
    save, crc, load, check = (statistics.median(x) for x in (saves, crcs, loads, checks))
    rows = [
        ("save_checkpoint (CRC-32 streamed while writing)", save, crc),
        ("load_checkpoint (every file checked before reading)", load, check),
    ]
    lines = [
        f"# Checkpoint integrity cost ({size / 1e6:.0f} MB checkpoint, {layers} x {width}^2 params, fp32 AdamW)",
        "",
        "| operation | median s | CRC-32 part s | CRC share |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {total:.3f} | {part:.3f} | {part / total:.1%} |" for name, total, part in rows]
    lines += [
        "",
        f"Candidate hashes over the same {size / 1e6:.0f} MB of files (page cache, 16 MiB reads):",
        "",
        "| hash | median s | GB/s | share of the save |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {t:.3f} | {size / t / 1e9:.2f} | {t / save:.1%} |" for name, t in hashes.items()]
    lines += ["", "Machine:", *machine_facts(ROOT, load_before, busy_cores=1)]
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    out = os.path.join(ROOT, "benchmarks", "results", "checkpoint.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["save", "load"]
    ax.barh(names, [save, load], label="total")
    ax.barh(names, [crc, check], label="CRC-32 part")
    ax.set_xlabel("seconds (median of 3)")
    ax.set_title(f"Checkpoint integrity cost, {size / 1e6:.0f} MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.replace(".md", ".png"), dpi=100)


if __name__ == "__main__":
    main()
