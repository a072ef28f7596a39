"""Reusable gradient bucket buffers (stage 2's buckets, and stage 3's without the arena)."""

from __future__ import annotations

import torch


class BucketPool:
    """Reusable bucket buffers, allocated once (fresh memory costs first-touch page faults).

    Every buffer of a dtype has the size of the largest bucket (`capacity`), so buckets of
    different groups share them and the pool's memory is set by the config, not by the model.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> full buffer handed out
        self.allocated_bytes = 0

    @property
    def in_use(self) -> int:
        return len(self._lent)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.setdefault((dtype, device), [])
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]  # larger requests get their own size
        if fitting:
            buf = free.pop(min(fitting, key=lambda i: free[i].numel()))
        else:
            buf = torch.empty(max(numel, self.capacity), dtype=dtype, device=device)
            self.allocated_bytes += buf.numel() * buf.element_size()
        self._lent[buf.data_ptr()] = buf
        return buf[:numel]

    def release(self, view: torch.Tensor) -> None:
        buf = self._lent.pop(view.data_ptr())
        self._free.setdefault((buf.dtype, buf.device), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
        self.allocated_bytes = 0
