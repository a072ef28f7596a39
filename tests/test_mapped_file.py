"""engine/offload/mapped_file.py: a swap file mapped as a tensor (stage 3's gradients on NVMe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.offload import DiskFullError, MappedFile, SwapDir
from engine.ops.aio import free_bytes


def _resident_kib(path: Path) -> int:
    """Rss of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's header line (address range first)
                inside = len(fields) > 5 and fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_released_pages_leave_memory_and_keep_their_values(tmp_path: Path) -> None:
    mapped = MappedFile(tmp_path, "grad.0", 1 << 20, torch.float32)
    assert os.path.getsize(mapped.path) == 4 << 20  # reserved whole at creation
    t = mapped.tensor
    assert torch.count_nonzero(t) == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert _resident_kib(mapped.path) >= 4096
    mapped.release(t[: t.numel() // 2])
    assert _resident_kib(mapped.path) <= 2048 + 4  # the released half is out (a partial page may stay)
    mapped.release(t)
    assert _resident_kib(mapped.path) == 0
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))  # read back from the file
    mapped.close()
    assert not mapped.path.exists()


def test_a_full_disk_is_named_before_anything_is_mapped(tmp_path: Path) -> None:
    too_many = free_bytes(str(tmp_path)) // 4 + (1 << 30)
    with pytest.raises(DiskFullError, match="bytes free") as err:
        MappedFile(tmp_path, "grad.0", too_many, torch.float32)
    assert str(tmp_path) in str(err.value)
    assert not (tmp_path / "grad.0.swp").exists()


def test_the_swap_folder_removes_its_mapped_files(tmp_path: Path) -> None:
    folder = SwapDir.create(tmp_path, 0, "run1")
    mapped = folder.mapped("grad.0", 1024, torch.float32)
    with pytest.raises(ValueError, match="already exists"):
        folder.mapped("grad.0", 1024, torch.float32)
    mapped.tensor.fill_(3.0)
    folder.close()
    assert not mapped.path.exists() and not folder.path.exists()
    assert float(mapped.tensor.sum()) == 3.0 * 1024  # the mapping outlives the name until the tensor goes


def _read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


def test_discarded_pages_are_overwritten_without_reading_the_disk(tmp_path: Path) -> None:
    """A store into a page of a file mapping that is not in memory reads the page from disk first; after
    discard() it must not (the values are zeros in the file), where the file system can zero a range."""
    numel = 4 << 20  # 16 MiB of float32
    mapped = MappedFile(tmp_path, "grad.0", numel, torch.float32)
    t = mapped.tensor
    values = torch.arange(numel, dtype=torch.float32)

    def overwrite_from_disk() -> int:
        """Bytes read from the disk by overwriting every page while none of the file is cached."""
        os.sync()
        fd = os.open(mapped.path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the page cache
        os.close(fd)
        before = _read_bytes()
        t.copy_(values)
        return _read_bytes() - before

    t.copy_(values)
    mapped.release(t)
    baseline = overwrite_from_disk()  # released, not discarded: the old pages are read back to be overwritten
    mapped.discard(t[1000:])  # all but the first page (and its partial neighbour) of the file
    if mapped.zeroes_ranges:
        assert torch.count_nonzero(t[1024:]) == 0 and torch.equal(t[:1000], values[:1000])
        mapped.release(t)
        discarded = overwrite_from_disk()
        assert baseline >= 8 << 20, baseline  # the test measures what it claims to (most of the 16 MiB read)
        assert discarded <= baseline // 8, (discarded, baseline)
    else:  # no zeroing here (tmpfs): the values stay, as release() keeps them
        assert torch.equal(t, values)
    assert torch.equal(t, values)
    mapped.close()
