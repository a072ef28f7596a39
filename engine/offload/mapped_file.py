"""A swap file mapped into memory: a plain tensor whose pages live in a file under nvme_path.

    f = MappedFile(folder, "grad.3", numel, torch.float32)   # space reserved now (or DiskFullError)
    g = f.tensor                     # reads as zeros; written in place like any tensor
    f.release(g[lo:hi])              # those pages leave this process's memory; the values stay in the file
    f.discard(g[lo:hi])              # the values are not needed again: the next store reads nothing from disk

# [Note: state the step touches in place]
Stage 3's shard gradients are written by the reduce-scatter of each unit, read for the global norm,
scaled, and read by the Adam step: several consumers that each want a tensor, at 4 bytes per parameter
of this rank's shard (a 3B model's gradients are 6 GB per rank at 2 ranks). With the optimizer on NVMe
they are the one part of the model states still in memory. Rather than a second swap protocol for
every consumer, the gradient is a MAP_SHARED mapping of a swap file: the consumers read and write it
unchanged (bitwise the same arithmetic), and the kernel moves its pages to and from the disk. Each
unit's gradient range leaves this process's memory as soon as its reduction is done (release(), i.e.
madvise MADV_DONTNEED: for a shared file mapping the values stay in the file and the page cache, and
the next touch reads them back), and again after the optimizer step. What stays is clean page cache,
which the kernel reclaims when memory is short (MemAvailable counts it); dirty pages are written back
by the kernel (at most vm.dirty_ratio of memory is dirty at a time). The two big transfers, the
reduction's write and the step's read, go past the mapping: see [Note: gradients past the page cache].

After the optimizer step has read a gradient it is not needed again (the next backward overwrites it),
and its values would cost a disk read each: a store into a page of a file mapping that is not in memory
reads the whole page from disk first, even to overwrite it. At 3.65B parameters that was 5.7 GB of
4 KiB reads a rank in every backward, made by the reduce-scatter's stores, one page fault at a time.
discard() turns the range into zeros in the file without writing them (fallocate FALLOC_FL_ZERO_RANGE:
the blocks stay reserved, marked unwritten) and drops its pages, so the next store into a page only
zero-fills it. Where the file system cannot zero a range (tmpfs: no disk to read from anyway) it
releases the pages like release() and the old values stay.

# [Note: gradients past the page cache]
Stores through the mapping cost more than the disk: every page of a gradient passes through a fresh
page-cache page, and touching fresh memory is slow (on this VM, whose freed pages go back to the host,
more so). Measured at 3.65B parameters, the zero-fill and copy of those pages were a fifth to a quarter
of the backward's CPU, 7-10 s a rank a step; writing them with pwrite() instead only moved the cost
into the copy. So the two big transfers bypass the page cache: stage 3's reduction writes each
gradient with O_DIRECT from a few reused staging buffers (engine/offload/staged_writes.py), and the
optimizer step reads it with O_DIRECT into its sub-group buffers (`file`, `offset`), both through
engine/ops/aio.py. The kernel keeps the mapping coherent with them (a direct write drops cached pages
of its range; a direct read writes dirty ones back first), so everything else still reads and writes
`tensor`: the norm's fallback, an accumulation's add, a checkpoint.

A mapped file must have its blocks reserved: a store into a hole on a full disk would kill the
process with SIGBUS instead of raising. So creation checks the free space and posix_fallocates the
whole size (DiskFullError before anything is mapped); a file system without fallocate is refused by
name rather than mapped sparse.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import torch

from engine.offload.swap_file import SUFFIX, check_name, check_space, reserve
from engine.ops.aio import open_file

_MADV_DONTNEED = 4
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_ZERO_RANGE = 0x01, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


class MappedFile:
    """`<folder>/<name>.swp`, `numel` elements of `dtype`, reserved on disk and mapped shared as `tensor`."""

    def __init__(self, folder: Path, name: str, numel: int, dtype: torch.dtype) -> None:
        check_name(name, numel)
        self.path = Path(folder) / f"{name}{SUFFIX}"
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = str(self.path)
        check_space(folder, path, self.nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            reserve(fd, path, self.nbytes, sparse_ok=False)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        try:
            self.tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd
        """Kept open for discard()'s fallocate."""
        try:
            self.file = open_file(path)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        """The file for engine/ops/aio.py (an O_DIRECT descriptor too): see [Note: gradients past the page
        cache]."""
        self.zeroes_ranges = True
        """Whether discard() zeroes (False once the file system refused FALLOC_FL_ZERO_RANGE)."""

    def _pages(self, view: torch.Tensor) -> tuple[int, int]:
        """[lo, hi): the addresses of the pages wholly inside `view`, a contiguous view of `tensor`."""
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        page = mmap.PAGESIZE
        return -(-start // page) * page, end // page * page

    def release(self, view: torch.Tensor) -> None:
        """Drop the pages wholly inside `view` (a contiguous view of `tensor`) from this process's memory;
        their values stay in the file (see [Note: state the step touches in place])."""
        lo, hi = self._pages(view)
        if hi > lo and _libc.madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) on {self.path}: {os.strerror(err)}")

    def discard(self, view: torch.Tensor) -> None:
        """The values in `view` are not needed again: its whole pages read as zeros from now on, with no
        write, their blocks still reserved, and leave memory (see [Note: state the step touches in
        place]); where the file system cannot zero a range, release(view) instead (values kept)."""
        lo, hi = self._pages(view)
        if hi <= lo:
            return
        if self.zeroes_ranges:
            offset = lo - self.tensor.data_ptr()
            if _libc.fallocate(self._fd, _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE, offset, hi - lo) == 0:
                return  # the kernel dropped the range's pages from the page cache and every mapping
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(err, f"fallocate(FALLOC_FL_ZERO_RANGE) on {self.path}: {os.strerror(err)}")
            self.zeroes_ranges = False
        self.release(view)

    def offset(self, view: torch.Tensor) -> int:
        """The byte offset in the file of `view`, a contiguous view of `tensor` (ValueError otherwise)."""
        start = view.data_ptr() - self.tensor.data_ptr()
        if not view.is_contiguous() or start < 0 or start + view.numel() * view.element_size() > self.nbytes:
            raise ValueError(f"{self.path}: a contiguous view of its mapping is needed, got another tensor")
        return start

    def close(self) -> None:
        """Remove the file; the mapping stays valid until the last tensor viewing it is freed."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.file.close()
        self.path.unlink(missing_ok=True)
