"""Consolidating a checkpoint into safetensors at disk speed: values go from the rank files' bytes to the
output's bytes inside the kernel, by worker processes, and never all sit in memory.

# [Note: copying a tensor's pieces file to file]
The rank files are opened with torch.load(weights_only=True, mmap=True): no value is read, and each
saved piece is a view into the file's mapping. Its address, looked up in /proc/self/maps, gives the
file and byte offset that hold it (torch stores a tensor's bytes uncompressed in its zip file). The
output's header is written first (every name, dtype and shape comes from the manifest,
safetensors_writer.py), so each piece has a known destination too: the plan is a list of Copy runs
(source file and offset -> output file and offset), cut at TASK_BYTES so the workers share them
evenly. A worker reads its runs' bytes front to back in blocks of SCAN_BYTES (consolidate_copy.scan_file)
and writes each block's part of every run it holds, cast on the way with --dtype bf16: a process holds a
block at most, not a tensor. (os.copy_file_range did the kept-dtype runs before, with no user-space
copy: the same speed from the page cache, 25% slower from a cold file, whose readahead came in smaller
requests than these blocks.) A piece that is not a plain view of a file (a tensor-parallel tensor, whose slices are joined
along partition_dim and stride) is assembled in memory by the main process and written with pwrite:
one tensor at a time.

Every output file is written under <name>.tmp.<pid>, fsynced, and renamed only when all are complete;
a failure removes them, so a failed run leaves no half output. The engine's rank files' CRC-32s are
checked on the way: a worker reads each rank file once, front to back, taking its CRC-32 and writing
the runs it holds from the same blocks (consolidate_copy.scan_file), so verifying costs no second
read; a mismatch fails the run before anything is renamed. Of an optimizer file that the manifest's
masters_checksums lists (files.py) only the head is read and checked, up to the end of its masters, which
hold every value copied from it: not its Adam moments, two thirds of it. DeepSpeed's files (no
checksums), and verify=False, copy only the runs' bytes.
"""

from __future__ import annotations

import bisect
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from engine.checkpoint.atomic_file import atomic_open, fsync_dir, fsync_path
from engine.checkpoint.consolidate_copy import (
    TASK_BYTES,
    Copy,
    close_files,
    init_worker,
    open_fd,
    pwrite,
    scan_file,
    tasks,
)
from engine.checkpoint.consolidate_plan import Entry, assemble, open_checkpoint, plan
from engine.checkpoint.deepspeed_format import is_deepspeed_tag_dir
from engine.checkpoint.files import CheckpointError, check_checksum, model_file, optim_file
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.safetensors_writer import (
    INDEX_NAME,
    SHARD_PATTERN,
    WEIGHTS_NAME,
    Shard,
    TensorSpec,
    build_shard,
    index_json,
    parse_size,
    shard_names,
    split_shards,
)

_T = TypeVar("_T")
_R = TypeVar("_R")


def default_workers() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def write_file(
    tag_dir: str,
    path: str,
    dtype: torch.dtype = torch.float32,
    workers: int | None = None,
    progress: bool = False,
    verify: bool = True,
) -> int:
    """The consolidated state dict of a tag directory (engine or DeepSpeed) as one .safetensors file at
    `path`. Returns the bytes of tensor data written. verify=False skips the CRC-32 check of the
    engine's rank files (which reads every byte of them, optimizer moments included)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    source = _Source(tag_dir, dtype, workers, verify)
    try:
        shard = build_shard(os.path.basename(path), source.specs, {"source": tag_dir})
        source.write([(shard, path)], progress)
    finally:
        source.close()
    return sum(spec.nbytes for spec in shard.tensors)


def write_dir(
    tag_dir: str,
    out_dir: str,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = "5GB",
    workers: int | None = None,
    progress: bool = False,
    verify: bool = True,
) -> list[str]:
    """The consolidated state dict as transformers lays it out in out_dir: model.safetensors, or shards
    of at most max_shard_size and model.safetensors.index.json. Other files there (config.json) are
    kept; shards and an index of an earlier run that this one does not write are removed. Returns the
    names written. max_shard_size None: one file."""
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    os.makedirs(out_dir, exist_ok=True)
    source = _Source(tag_dir, dtype, workers, verify)
    try:
        runs = split_shards(source.specs, limit)
        names = shard_names(len(runs))
        shards = [build_shard(name, run) for name, run in zip(names, runs)]
        source.write([(shard, os.path.join(out_dir, shard.name)) for shard in shards], progress)
    finally:
        source.close()
    if len(shards) > 1:
        with atomic_open(os.path.join(out_dir, INDEX_NAME)) as f:
            f.write(index_json(shards))
    written = names + ([INDEX_NAME] if len(shards) > 1 else [])
    for stale in os.listdir(out_dir):  # an earlier run's other shards or index would mislead a loader
        if (SHARD_PATTERN.fullmatch(stale) or stale in (WEIGHTS_NAME, INDEX_NAME)) and stale not in written:
            os.unlink(os.path.join(out_dir, stale))
    fsync_dir(out_dir)
    return written


class _Source:
    """An opened checkpoint, its plan and a pool of workers (forked: no second import of torch); close()
    when done."""

    def __init__(self, tag_dir: str, dtype: torch.dtype, workers: int | None, verify: bool = True) -> None:
        self.workers = default_workers() if workers is None else max(1, workers)
        self.pool = multiprocessing.get_context("fork").Pool(self.workers, init_worker) if self.workers > 1 else None
        try:
            # path -> the manifest's {"crc32", "bytes"}: checked while the copies read the files
            self.reader, manifest = open_checkpoint(tag_dir, verified=True)
            self.checksums = _checksums(tag_dir, manifest) if verify else {}
            self.entries = plan(self.reader, manifest, dtype)
        except BaseException:
            self.close()
            raise
        self.specs = [TensorSpec(e.name, e.dtype, tuple(e.shape)) for e in self.entries]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
        close_files()

    def _map(self, fn: Callable[[_T], _R], items: list[_T]) -> Iterator[_R]:
        """fn over items, in the workers (in any order) or here when there is one worker."""
        return map(fn, items) if self.pool is None else self.pool.imap_unordered(fn, items)

    def write(self, outputs: list[tuple[Shard, str]], progress: bool) -> None:
        """Every output file complete under its name, or none of them (see the module's note)."""
        tmps = [f"{path}.tmp.{os.getpid()}" for _, path in outputs]
        try:
            copies, in_memory = self._plan_copies([(shard, tmp) for (shard, _), tmp in zip(outputs, tmps)])
            for (shard, _), tmp in zip(outputs, tmps):
                with open(tmp, "wb") as f:
                    f.write(shard.header)
                    f.truncate(shard.size)
            total = sum(c.numel * c.src_dtype.itemsize for c in copies)
            with tqdm(total=total, unit="B", unit_scale=True, desc="consolidating", disable=not progress) as bar:
                for entry, tmp, offset in in_memory:  # joined in memory, one tensor at a time
                    _pwrite_all(tmp, assemble(self.reader, entry).to(entry.dtype), offset)
                # A checked file is one task, read once: its CRC-32 and its runs from the same blocks; the
                # runs of the others are read alone, in tasks of TASK_BYTES.
                checked = {
                    path: (_within_checked(path, [c for c in copies if c.src == path], check), check["bytes"])
                    for path, check in self.checksums.items()
                }
                unchecked = tasks([c for c in copies if c.src not in checked])
                for path, found, done in self._map(scan_file, [*checked.items(), *unchecked]):
                    if path in checked:
                        check_checksum(path, found, self.checksums[path])
                    bar.update(done)
            for tmp in tmps:
                fsync_path(tmp)
            for (_, path), tmp in zip(outputs, tmps):
                os.replace(tmp, path)
        except BaseException:
            for tmp in tmps:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            raise
        for directory in {os.path.dirname(os.path.abspath(path)) for _, path in outputs}:
            fsync_dir(directory)

    def _plan_copies(self, outputs: list[tuple[Shard, str]]) -> tuple[list[Copy], list[tuple[Entry, str, int]]]:
        """The Copy runs of every tensor that is a view of its files, and (entry, file, offset) of the rest."""
        by_name = {e.name: e for e in self.entries}
        located: list[tuple[Entry, str, int, list[tuple[int, torch.Tensor]]]] = []
        in_memory: list[tuple[Entry, str, int]] = []
        for shard, dst in outputs:
            for spec, start in zip(shard.tensors, shard.starts):
                entry = by_name[spec.name]
                if len(entry.parts) != 1:
                    in_memory.append((entry, dst, start))
                else:
                    located.append((entry, dst, start, _pieces(self.reader, entry)))
        self._check_masters_storage()
        maps = _Mappings()
        copies: list[Copy] = []
        for entry, dst, start, pieces in located:
            runs = _runs(entry, dst, start, pieces, maps)
            if runs is None:
                in_memory.append((entry, dst, start))
            else:
                copies.extend(runs)
        return copies, in_memory

    def _check_masters_storage(self) -> None:
        """Of each optimizer file checked only up to its masters' end: its masters' storage, which every
        master piece is a view of (the checked pickle says so), lies exactly where the manifest's checksum
        covers it. Where a storage lies comes from the zip's directory at the file's end, which is not
        checked: this keeps any value, copied or joined in memory, inside the checked bytes."""
        ranks = [
            (rank, path)
            for rank in range(len(self.reader.manifest["pieces"]))
            if self.checksums.get(
                path := os.path.realpath(os.path.join(self.reader.tag_dir, optim_file(rank))), {}
            ).get("start")
        ]
        files = {rank: self.reader.file(optim_file(rank)) for rank, _ in ranks}  # mapped before maps are read
        maps = _Mappings()
        for rank, path in ranks:
            check = self.checksums[path]
            pieces = files[rank].get("pieces")
            masters = [e["master"] for es in pieces.values() for e in es] if isinstance(pieces, dict) else []
            storage = masters[0].untyped_storage() if masters and torch.is_tensor(masters[0]) else None
            whole = None if storage is None else torch.empty(0, dtype=torch.uint8).set_(storage)
            if (
                whole is None
                or maps.locate(whole) != (path, check["start"])
                or whole.numel() != check["bytes"] - check["start"]
            ):
                raise CheckpointError(
                    f"{path}: its masters are not at bytes [{check['start']}, {check['bytes']}), where the "
                    "manifest's checksum covers them; the file was modified or damaged after it was saved; "
                    "load an earlier tag"
                )


def _pieces(reader: PieceReader, entry: Entry) -> list[tuple[int, torch.Tensor]]:
    """(first element, flat view) of each saved piece of a one-part tensor, in order, tiling it exactly;
    a gap or a piece shorter than its manifest entry is named (tensor, file)."""
    name, kind = entry.parts[0][0], entry.kind
    key = "master" if kind == "optim" else "model"
    out: list[tuple[int, torch.Tensor]] = []
    at = 0
    for offset, numel, rank in sorted(reader.where[name][kind]):
        fname = model_file(rank) if kind == "model" else optim_file(rank)
        data = reader.file(fname)
        if kind == "model" and name in data.get("whole", {}):
            src = data["whole"][name].reshape(-1)
        else:
            value = reader.entry(fname, name, offset).get(key)
            if not torch.is_tensor(value):
                raise CheckpointError(
                    f"{os.path.join(reader.tag_dir, fname)} lacks {key!r} of {name!r} at offset {offset} "
                    "that the checkpoint lists; the checkpoint is corrupted; load another tag"
                )
            src = value.reshape(-1)
        if offset > at:
            raise CheckpointError(
                f"{reader.tag_dir}: no file holds elements [{at}, {offset}) of {name!r}; the checkpoint "
                "is incomplete or corrupted; load another tag"
            )
        if src.numel() < numel:
            raise CheckpointError(
                f"{os.path.join(reader.tag_dir, fname)}: {key!r} of {name!r} at offset {offset} holds "
                f"{src.numel()} elements, the checkpoint lists {numel}; the file is corrupted; load another tag"
            )
        if offset + numel > at:  # overlapping pieces hold the same values: the new part only
            out.append((at, src[at - offset : numel]))
            at = offset + numel
    if at != entry.numel:
        raise CheckpointError(
            f"{reader.tag_dir}: no file holds elements [{at}, {entry.numel}) of {name!r}; the checkpoint "
            "is incomplete or corrupted; load another tag"
        )
    return out


def _runs(
    entry: Entry, dst: str, start: int, pieces: list[tuple[int, torch.Tensor]], maps: _Mappings
) -> list[Copy] | None:
    """A tensor's Copy runs, each at most TASK_BYTES of source; None when a piece is not in a file."""
    runs: list[Copy] = []
    for first, view in pieces:
        where = maps.locate(view)
        if where is None:
            return None
        path, offset = where
        size = view.element_size()
        step = max(1, TASK_BYTES // size)
        for lo in range(0, view.numel(), step):
            n = min(step, view.numel() - lo)
            dst_offset = start + (first + lo) * entry.dtype.itemsize
            runs.append(Copy(entry.name, path, offset + lo * size, dst, dst_offset, n, view.dtype, entry.dtype))
    return runs


class _Mappings:
    """This process's file mappings (/proc/self/maps): which file and offset an address reads."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int, str]] = []  # (start, end, file offset, path), by start
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith("(deleted)\n"):
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        self.spans.append((lo, hi, int(fields[2], 16), fields[5].rstrip("\n")))
        except OSError:  # not Linux: every tensor goes the in-memory way
            pass
        self.spans.sort()
        self.starts = [s[0] for s in self.spans]

    def locate(self, t: torch.Tensor) -> tuple[str, int] | None:
        if not t.is_contiguous() or t.numel() == 0:
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None
        lo, hi, offset, path = self.spans[i]
        if ptr + nbytes > hi or not os.path.isfile(path):
            return None
        return path, offset + ptr - lo


def _pwrite_all(path: str, flat: torch.Tensor, offset: int) -> None:
    pwrite(open_fd(path, os.O_WRONLY), flat.contiguous().view(torch.uint8).numpy().data, offset)


def _checksums(tag_dir: str, manifest: dict[str, Any]) -> dict[str, dict[str, int]]:
    """What to check of each of the engine's rank files, by real path (as /proc/self/maps names them):
    {"crc32", "bytes", "start"}, the CRC-32 of its first "bytes" bytes, and from which byte the values
    copied from it may be taken. For an optimizer file in masters_checksums (files.py) that is the
    head of the file up to the end of the masters; otherwise the whole file, from byte 0. A missing or
    resized file is named here, before anything is loaded. DeepSpeed keeps no checksums."""
    if is_deepspeed_tag_dir(tag_dir):
        return {}
    out = {}
    for name, expected in manifest.get("checksums", {}).items():
        path = os.path.realpath(os.path.join(tag_dir, name))
        if not os.path.isfile(path):
            raise CheckpointError(f"{os.path.join(tag_dir, name)} is missing; the checkpoint is incomplete")
        check_checksum(path, {"crc32": expected["crc32"], "bytes": os.path.getsize(path)}, expected)
        masters = manifest.get("masters_checksums", {}).get(name)
        if masters is None:
            out[path] = {"crc32": expected["crc32"], "bytes": expected["bytes"], "start": 0}
        else:
            end = masters["offset"] + masters["bytes"]
            out[path] = {"crc32": masters["crc32"], "bytes": end, "start": masters["offset"]}
    return out


def _within_checked(path: str, copies: list[Copy], check: dict[str, int]) -> list[Copy]:
    """copies (all from `path`), refused by name if one takes bytes outside the part of the file its
    checksum covers (the zip's directory, which is not checked, would have to point elsewhere)."""
    for c in copies:
        end = c.src_offset + c.numel * c.src_dtype.itemsize
        if c.src_offset < check["start"] or end > check["bytes"]:
            raise CheckpointError(
                f"{path}: {c.tensor!r} is read from bytes [{c.src_offset}, {end}) but the manifest's "
                f"checksum covers its values at [{check['start']}, {check['bytes']}); the file was "
                "modified or damaged after it was saved; load an earlier tag"
            )
    return copies
