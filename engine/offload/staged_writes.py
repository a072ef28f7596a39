"""Writes through O_DIRECT from a ring of reused, aligned staging buffers.

    writer = StagedWriter(context)               # 4 buffers of 32 MiB, touched once
    writer.write(mapped.file, values, offset)     # copies a chunk at a time and starts its write
    writer.wait_all()                             # every write on disk (AioError/DiskFullError if not)

O_DIRECT needs the source address, the file offset and the size on a 4 KiB grid (engine/ops/aio.py,
DIRECT_ALIGN): a rank's slice of a reduced gradient bucket is only 128-byte aligned, so it is copied
into a staging buffer first, a chunk at a time, and the chunk's write started; a buffer is reused once
its write is done. The copy is of memory the reduction has just written (in cache), against a page
fault and a fresh page-cache page for every 4 KiB of the mapped-store path it replaces ([Note:
gradients past the page cache] in engine/offload/mapped_file.py). A partial last block of a write goes
through the page cache (aio's rule), so any size and any aligned offset are taken.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.ops.aio import DIRECT_ALIGN, AioContext, IOHandle, OpenFile, aligned_empty

CHUNK_BYTES = 32 << 20
"""Bytes per staging buffer (a multiple of DIRECT_ALIGN, so every chunk but a write's last is direct)."""
BUFFERS = 4
"""Staging buffers: writes in flight while the next chunk is copied."""


class StagedWriter:
    """Writes of CPU tensors into files through `context`, staged in BUFFERS aligned buffers."""

    def __init__(self, context: AioContext, chunk_bytes: int = CHUNK_BYTES, buffers: int = BUFFERS) -> None:
        if chunk_bytes <= 0 or chunk_bytes % DIRECT_ALIGN:
            raise ValueError(f"staging chunks must be a positive multiple of {DIRECT_ALIGN} bytes, got {chunk_bytes}")
        self._context = context
        self._chunk = chunk_bytes
        self._free = [aligned_empty(chunk_bytes, torch.uint8) for _ in range(buffers)]
        self._in_flight: deque[tuple[torch.Tensor, IOHandle]] = deque()
        self.bytes_written = 0
        """Bytes handed to write() so far (counted for tests and reports)."""

    def write(self, file: OpenFile, values: torch.Tensor, offset: int) -> None:
        """Start writing `values` (contiguous, CPU) at byte `offset` (a multiple of DIRECT_ALIGN) of `file`;
        `values` may change once this returns (its bytes are in the staging buffers)."""
        if offset % DIRECT_ALIGN:
            raise ValueError(f"staged write to {file.path}: offset {offset} is not a multiple of {DIRECT_ALIGN}")
        if not values.is_contiguous() or not values.is_cpu:
            raise ValueError(f"staged write to {file.path}: a contiguous CPU tensor is needed")
        data = values.reshape(-1).view(torch.uint8)
        for lo in range(0, data.numel(), self._chunk):
            piece = data[lo : lo + self._chunk]
            buffer = self._take()
            staged = buffer[: piece.numel()]
            staged.copy_(piece)
            self._in_flight.append((buffer, self._context.write(file, staged, offset + lo)))
        self.bytes_written += data.numel()

    def _take(self) -> torch.Tensor:
        if not self._free:
            buffer, handle = self._in_flight.popleft()
            self._free.append(buffer)  # back to the ring even if the write failed: the error is raised below
            handle.wait()
        return self._free.pop()

    def wait_all(self) -> None:
        """Wait for every write started; raise the first failure (AioError, DiskFullError) after all ended."""
        first: BaseException | None = None
        while self._in_flight:
            buffer, handle = self._in_flight.popleft()
            try:
                handle.wait()
            except BaseException as error:  # noqa: BLE001 - every write is waited for before any is raised
                first = first or error
            self._free.append(buffer)
        if first is not None:
            raise first
