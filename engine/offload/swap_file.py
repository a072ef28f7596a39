"""A swap file: a named file of a fixed number of elements of one dtype, read and written by element
ranges through an AioContext, with every size checked.

    f = SwapFile(folder, "exp_avg.3", numel, torch.float32, context)  # space reserved now (or DiskFullError)
    f.write(shard, offset=0).wait()     # elements [0, shard.numel()) of the file
    f.read(buffer, offset=0).wait()     # the same elements back

[Note: what a swap file checks]
DeepSpeed's users saw swap files silently empty or of the wrong size (its issues 1070, 1627, 3062,
3376). Here:
- creation reserves the whole size (posix_fallocate; ftruncate where the file system cannot), after
  checking the free space, so a full disk is a DiskFullError before anything is written;
- the file's size is checked against the size it was created with before every read and write and
  after every write (truncated, extended or removed by anyone: SwapFileError naming both sizes);
- a read of elements no completed write covered is a SwapFileError: fallocated space reads as zeros,
  so it would otherwise look like data. A write in flight, or one that failed, leaves its range
  uncovered;
- a transfer that moves fewer bytes than asked raises the AioError/DiskFullError of engine/ops/aio.py.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from pathlib import Path

import torch

from engine.offload.errors import SwapFileError
from engine.ops.aio import AioContext, DiskFullError, IOHandle, free_bytes, open_file, transfer_error, wait_each

SUFFIX = ".swp"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_name(name: str, numel: int) -> None:
    """A swap file's name and size as asked for: a ValueError naming what is wrong."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"swap file name {name!r}: use letters, digits, '_', '.' and '-' only")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
        raise ValueError(f"swap file {name!r}: numel must be a positive integer, got {numel!r}")


class Ranges:
    """Disjoint, sorted half-open element ranges [lo, hi) (the elements a completed write covers)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        self.remove(lo, hi)
        merged_lo, merged_hi, keep = lo, hi, []
        for a, b in self.spans:
            if b == merged_lo:
                merged_lo = a
            elif a == merged_hi:
                merged_hi = b
            else:
                keep.append((a, b))
        self.spans = sorted([*keep, (merged_lo, merged_hi)])

    def remove(self, lo: int, hi: int) -> None:
        kept: list[tuple[int, int]] = []
        for a, b in self.spans:
            if b <= lo or a >= hi:
                kept.append((a, b))
                continue
            if a < lo:
                kept.append((a, lo))
            if b > hi:
                kept.append((hi, b))
        self.spans = kept

    def first_gap(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The first sub-range of [lo, hi) no span covers, or None when all of it is covered."""
        at = lo
        for a, b in self.spans:
            if b <= at:
                continue
            if a > at:
                return at, min(a, hi)
            at = b
            if at >= hi:
                return None
        return (at, hi) if at < hi else None


class SwapHandle:
    """A swap file's transfer in flight: wait() returns the bytes moved after the file's checks, or
    raises (AioError/DiskFullError from the transfer, SwapFileError from the checks)."""

    def __init__(self, swap: SwapFile, io: IOHandle, write: bool, lo: int, hi: int) -> None:
        self.swap, self.io, self.write, self.lo, self.hi = swap, io, write, lo, hi

    def wait(self) -> int:
        moved = self.io.wait()
        self.swap.check_size()
        if self.write:
            with self.swap._lock:
                self.swap.written.add(self.lo, self.hi)
        return moved

    def done(self) -> bool:
        return self.io.done()


class SwapFile:
    """`<folder>/<name>.swp`, `numel` elements of `dtype`, space reserved at creation; see [Note: what a
    swap file checks]. Element offsets everywhere (bytes only in messages)."""

    def __init__(self, folder: Path, name: str, numel: int, dtype: torch.dtype, context: AioContext) -> None:
        check_name(name, numel)
        self.path = Path(folder) / f"{name}{SUFFIX}"
        self.name, self.numel, self.dtype, self.context = name, numel, dtype, context
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * self.element_size
        self.written = Ranges()
        self._lock = threading.Lock()  # guards `written` and `_in_flight` (handles may be waited on any thread)
        self._in_flight: list[IOHandle] = []  # waited before the descriptors close
        path = str(self.path)
        check_space(folder, path, self.nbytes)
        try:
            self._file = open_file(self.path, create=True)
        except FileExistsError as error:
            raise SwapFileError(f"swap file {path} already exists; each swap file name is used once") from error
        try:
            reserve(self._file.fd, path, self.nbytes, sparse_ok=True)
        except OSError:
            self._file.close()
            self.path.unlink(missing_ok=True)
            raise
        self._inode = os.fstat(self._file.fd).st_ino
        self.check_size()

    def write(self, tensor: torch.Tensor, offset: int = 0) -> SwapHandle:
        """Starts writing `tensor` (this file's dtype, contiguous, on the CPU) over elements [offset,
        offset + tensor.numel()); the range reads back only after the handle is waited."""
        lo, hi = self._check_range("write", tensor, offset)
        self.check_size()
        with self._lock:
            self.written.remove(lo, hi)  # overwritten from now on: not readable until this write is waited
        return SwapHandle(
            self, self._track(self.context.write(self._file, tensor, lo * self.element_size)), True, lo, hi
        )

    def read(self, tensor: torch.Tensor, offset: int = 0) -> SwapHandle:
        """Starts reading elements [offset, offset + tensor.numel()) into `tensor`."""
        lo, hi = self._check_range("read", tensor, offset)
        self.check_size()
        with self._lock:
            gap = self.written.first_gap(lo, hi)
        if gap is not None:
            raise SwapFileError(
                f"swap file {self.path}: read of elements [{lo}, {hi}) but elements [{gap[0]}, {gap[1]}) were "
                "never written by a completed write (they would read as zeros); wait for the write first"
            )
        return SwapHandle(
            self, self._track(self.context.read(self._file, tensor, lo * self.element_size)), False, lo, hi
        )

    def _track(self, io: IOHandle) -> IOHandle:
        with self._lock:
            self._in_flight = [h for h in self._in_flight if not h.waited] + [io]
        return io

    def check_size(self) -> None:
        """SwapFileError when the file on disk is not the one created, or not of its size."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            on_disk = None
        if on_disk is None or on_disk.st_ino != self._inode:
            raise SwapFileError(
                f"swap file {self.path} was removed or replaced outside the engine; its contents are lost: "
                "keep other programs out of nvme_path and resume from the last checkpoint"
            )
        if on_disk.st_size != self.nbytes:
            raise SwapFileError(
                f"swap file {self.path} has {on_disk.st_size} bytes, expected {self.nbytes} ({self.numel} "
                f"{self.dtype} elements): it was truncated or extended outside the engine (or the disk lost "
                "it); its contents cannot be trusted: resume from the last checkpoint"
            )

    def _check_range(self, op: str, tensor: torch.Tensor, offset: int) -> tuple[int, int]:
        if self._file.fd < 0:
            raise ValueError(f"swap file {self.path} is closed")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"swap file {self.path} {op}: holds {self.dtype}, got {got}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"swap file {self.path} {op}: offset must be a non-negative integer, got {offset!r}")
        lo, hi = offset, offset + tensor.numel()
        if hi > self.numel:
            raise ValueError(
                f"swap file {self.path} {op}: elements [{lo}, {hi}) but the file holds {self.numel} elements"
            )
        return lo, hi

    def close(self, remove: bool = True) -> None:
        """Waits for this file's transfers still in flight (a descriptor closed under a transfer could be
        reused by another file), closes the file and, by default, removes it; then raises the first
        transfer's error, if one failed and was not waited for."""
        with self._lock:
            in_flight, self._in_flight = [h for h in self._in_flight if not h.waited], []
        first = wait_each(in_flight)
        if self._file.fd >= 0:
            self._file.close()
        if remove:
            self.path.unlink(missing_ok=True)
        if first is not None:
            raise first


def check_space(folder: Path, path: str, nbytes: int) -> None:
    """A DiskFullError before anything is created when the file system of `folder` has less free space."""
    free = free_bytes(str(folder))
    if free >= 0 and nbytes > free:
        raise DiskFullError("create", path, 0, nbytes, 0, errno.ENOSPC)


def reserve(fd: int, path: str, nbytes: int, *, sparse_ok: bool) -> None:
    """Allocates the file's blocks now, so a full disk fails here (DiskFullError, or the AioError of the
    failure) and not in the middle of a write. On a file system without fallocate the file is only sized
    (sparse_ok) or refused by name (a memory-mapped file must not be sparse: see mapped_file.py)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise transfer_error("create", path, 0, nbytes, os.fstat(fd).st_size, error.errno or errno.EIO) from error
        if not sparse_ok:
            raise OSError(
                error.errno,
                f"{path}: this file system cannot reserve space (posix_fallocate: {os.strerror(error.errno)}); "
                "a memory-mapped swap file needs it (a full disk would otherwise kill the process): "
                "put nvme_path on ext4, xfs, btrfs or tmpfs",
            ) from error
    try:
        os.ftruncate(fd, nbytes)  # no fallocate on this file system: sized, not reserved
    except OSError as error:
        raise transfer_error("create", path, 0, nbytes, os.fstat(fd).st_size, error.errno or errno.EIO) from error
