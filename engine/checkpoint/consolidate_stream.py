"""Consolidating a checkpoint into safetensors at disk speed: values go from the rank files' bytes to the
output's bytes inside the kernel, by worker processes, and never all sit in memory.

# [Note: copying a tensor's pieces file to file]
The rank files are opened with torch.load(weights_only=True, mmap=True): no value is read, and each
saved piece is a view into the file's mapping. Its address, looked up in /proc/self/maps, gives the
file and byte offset that hold it (torch stores a tensor's bytes uncompressed in its zip file). The
output's header is written first (every name, dtype and shape comes from the manifest,
safetensors_writer.py), so each piece has a known destination too: the plan is a list of Copy runs
(source file and offset -> output file and offset), cut at TASK_BYTES so the workers share them
evenly. A worker runs a run with os.copy_file_range (no user-space copy when the dtype is kept) or
reads, casts and writes it in TASK_BYTES chunks (--dtype bf16): a process holds a chunk at most, not a
tensor. A piece that is not a plain view of a file (a tensor-parallel tensor, whose slices are joined
along partition_dim and stride) is assembled in memory by the main process and written with pwrite:
one tensor at a time.

Every output file is written under <name>.tmp.<pid>, fsynced, and renamed only when all are complete;
a failure removes them, so a failed run leaves no half output. The engine's rank files' CRC-32s are
checked first, by the same workers.
"""

from __future__ import annotations

import bisect
import multiprocessing
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from engine.checkpoint.atomic_file import atomic_open, file_crc32, fsync_dir
from engine.checkpoint.consolidate_plan import Entry, assemble, open_checkpoint, plan
from engine.checkpoint.deepspeed_format import is_deepspeed_tag_dir
from engine.checkpoint.files import CheckpointError, model_file, optim_file, read_manifest
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

TASK_BYTES = 64 << 20
"""The most source bytes one worker task copies (and, when casting, holds)."""


@dataclass(frozen=True)
class Copy:
    """A run of one tensor's elements, from a rank file's bytes to an output file's."""

    tensor: str
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    numel: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype


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
        self.pool = multiprocessing.get_context("fork").Pool(self.workers, _init_worker) if self.workers > 1 else None
        try:
            if verify:
                _check_crcs(tag_dir, self._map)
            self.reader, manifest = open_checkpoint(tag_dir, verified=True)
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
        _close_files()

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
                for done in self._map(_run_copies, _tasks(copies)):
                    bar.update(done)
            for tmp in tmps:
                _fsync(tmp)
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
        maps = _Mappings()
        copies: list[Copy] = []
        for entry, dst, start, pieces in located:
            runs = _runs(entry, dst, start, pieces, maps)
            if runs is None:
                in_memory.append((entry, dst, start))
            else:
                copies.extend(runs)
        return copies, in_memory


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


# ---------------------------------------------------------------------------------- in the workers
_FILES: dict[tuple[str, int], int] = {}
"""This process's open descriptors by (path, flags), reused across tasks."""


def _init_worker() -> None:
    # One thread per worker (the pool is the parallelism), as DataLoader's forked workers do: it also
    # keeps a forked child out of an OpenMP pool its parent may have started.
    torch.set_num_threads(1)
    _FILES.clear()  # the parent's descriptors are inherited, but each worker opens its own


def _fd(path: str, flags: int) -> int:
    if (path, flags) not in _FILES:
        _FILES[(path, flags)] = os.open(path, flags)
    return _FILES[(path, flags)]


def _close_files() -> None:
    for fd in _FILES.values():
        os.close(fd)
    _FILES.clear()


def _tasks(copies: list[Copy]) -> list[list[Copy]]:
    """The worker tasks: every kept-dtype run into one output file is one task (writes into one file
    take its inode's lock, so two workers copying into it take turns and only add switching: they run
    in parallel on different shards); a cast run is a task of its own (the cast is the CPU's work)."""
    by_file: dict[str, list[Copy]] = {}
    cast: list[list[Copy]] = []
    for c in copies:
        if c.src_dtype == c.dst_dtype:
            by_file.setdefault(c.dst, []).append(c)
        else:
            cast.append([c])
    return sorted(by_file.values(), key=len, reverse=True) + cast


def _run_copies(copies: list[Copy]) -> int:
    return sum(_run_copy(c) for c in copies)


def _run_copy(c: Copy) -> int:
    """One Copy run; returns the source bytes copied."""
    try:
        src, dst = _fd(c.src, os.O_RDONLY), _fd(c.dst, os.O_WRONLY)
        nbytes = c.numel * c.src_dtype.itemsize
        if c.src_dtype == c.dst_dtype:
            _copy_bytes(src, c.src_offset, dst, c.dst_offset, nbytes)
        else:
            buf = bytearray(nbytes)
            if os.preadv(src, [buf], c.src_offset) != nbytes:
                raise EOFError("the file ends before the tensor's bytes do")
            cast = torch.frombuffer(buf, dtype=c.src_dtype).to(c.dst_dtype)
            _pwrite(dst, cast.view(torch.uint8).numpy().data, c.dst_offset)
    except (OSError, EOFError) as err:
        raise CheckpointError(
            f"{c.src}: copying {c.numel} elements of {c.tensor!r} from byte {c.src_offset} into {c.dst} "
            f"failed ({err}); the file is truncated or the disk is full"
        ) from None
    return nbytes


def _copy_bytes(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    """nbytes from src to dst inside the kernel (copy_file_range), or by pread/pwrite where it is missing."""
    done = 0
    while done < nbytes:
        try:
            n = os.copy_file_range(src, dst, nbytes - done, src_offset + done, dst_offset + done)
        except (AttributeError, OSError) as err:  # no copy_file_range here (or across these file systems)
            if isinstance(err, OSError) and err.errno not in (18, 22, 38, 95):  # EXDEV EINVAL ENOSYS EOPNOTSUPP
                raise
            n = _pwrite(
                dst, memoryview(os.pread(src, min(nbytes - done, 16 << 20), src_offset + done)), dst_offset + done
            )
        if n == 0:
            raise EOFError("the file ends before the tensor's bytes do")
        done += n


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return done


def _pwrite_all(path: str, flat: torch.Tensor, offset: int) -> None:
    _pwrite(_fd(path, os.O_WRONLY), flat.contiguous().view(torch.uint8).numpy().data, offset)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_crcs(
    tag_dir: str,
    mapper: Callable[[Callable[[str], tuple[str, dict[str, int]]], list[str]], Iterator[tuple[str, dict[str, int]]]],
) -> None:
    """The engine's rank files against their manifest's CRC-32 and size, one file per worker task."""
    if is_deepspeed_tag_dir(tag_dir):
        return  # DeepSpeed records no checksums
    checksums = read_manifest(tag_dir).get("checksums", {})
    paths = [os.path.join(tag_dir, name) for name in checksums]
    for path in paths:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    for path, crc in mapper(_crc, paths):
        expected = checksums[os.path.basename(path)]
        if crc != expected:
            what = (
                f"{crc['bytes']} bytes, the manifest says {expected['bytes']}"
                if crc["bytes"] != expected["bytes"]
                else f"CRC-32 {crc['crc32']:08x}, the manifest says {expected['crc32']:08x}"
            )
            raise CheckpointError(
                f"{path} was modified or damaged after it was saved ({what}); its values cannot be "
                "trusted: load an earlier tag"
            )


def _crc(path: str) -> tuple[str, dict[str, int]]:
    return path, file_crc32(path)
