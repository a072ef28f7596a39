"""A contiguous, pre-touched memory arena lending tensors from a best-fit free list (ZeRO-R, section 6.3).

    arena = Arena(256 << 20, config_key="zero_optimization.<the key that sizes it>")
    buf = arena.allocate((4096, 1024), torch.bfloat16)   # a view of one 64-byte-aligned block
    del buf                                              # the block is free again once no view is left
    arena.stats()   # capacity, in_use, peak_in_use, largest_free, free_blocks, allocations, fragmentation

Fresh memory pays a first-touch page fault per page (copies into it ran at 2.5-3.3 GB/s here against
10+ GB/s into touched memory) and glibc keeps freed memory resident and fragmented; the arena takes
one buffer at creation, writes every page once, and lends blocks out of it. A request that does not
fit raises RuntimeError naming the request, the arena's capacity, use and largest free block, and
the config key to raise.

Two free lists behind one `BlockArena`: the compiled one (csrc/cpu/arena.cpp, bound in
engine/ops/cpu_lib.py) when builder.load() gives the library; otherwise `_FreeList`, written here with
the same algorithm, so offsets, stats and error messages agree (tests/test_arena.py runs both in
lockstep; `TorchArena` is the fallback arena).

# [Note: how the fallback learns that a block is free]
(Both arenas lend blocks this way; only the free list differs.)
A block is free again when the last tensor sharing its storage dies, not when the tensor object that
allocate() returned dies: views (`buf[:n]`, `buf.view(...)`) keep the storage and therefore the bytes
in use. A weakref.finalize on the returned tensor would free the block under a live view, and a
finalizer on `tensor.untyped_storage()` depends on the Python wrapper of the storage staying tied to
it. So the fallback builds each block with torch.frombuffer on a ctypes array placed at the block's
address: the storage holds a reference to that ctypes object until the storage itself is freed, and
a weakref.finalize on the ctypes object fires exactly then, on whichever thread freed it. The
Python free list's finalizer only appends to a deque (atomic under the GIL); allocate() and stats()
apply those frees under the lock first. Taking the lock inside the finalizer could deadlock, because a
finalizer can run in the middle of allocate() on the same thread (a garbage collection triggered by an
allocation). The compiled free list gives the block back at once: its mutex is only held inside C++
calls that never call into Python. The finalizer's closure owns the free list, which owns the buffer,
so tensors may outlive the Arena object.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import threading
import weakref
from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypedDict

import torch

from engine.ops import builder
from engine.ops.cpu_lib import thread_count

BLOCK_ALIGN = 64
"""Bytes: every block starts on a cache line and its size is rounded up to one."""


class ArenaStats(TypedDict):
    capacity: int  # bytes, the requested capacity rounded up to BLOCK_ALIGN
    in_use: int  # bytes in live blocks (each request rounded up to BLOCK_ALIGN)
    peak_in_use: int
    largest_free: int  # bytes in the largest free block: the largest request that fits now
    free_blocks: int
    allocations: int  # live blocks (zero-byte tensors take none)
    fragmentation: float  # 1 - largest_free / free bytes; 0 when nothing is free


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def block_bytes(nbytes: int) -> int:
    """Bytes an arena spends on a request of `nbytes` (rounded up to BLOCK_ALIGN): what sizing an arena
    for known requests adds up."""
    return _round_up(nbytes, BLOCK_ALIGN)


class Usage(NamedTuple):
    """A consistent snapshot of a free list's accounting, in bytes (the fields of ArenaStats but one)."""

    capacity: int
    in_use: int
    peak_in_use: int
    largest_free: int
    free_blocks: int
    allocations: int


class FreeList(Protocol):
    """What BlockArena needs of a free list over [base, base + capacity): `_FreeList` here, or the
    compiled one (engine/ops/cpu_lib.py). take and usage may be called from any thread; give_back from
    a block's finalizer on any thread, maybe inside take on the same thread."""

    base: int  # address of byte 0, a multiple of BLOCK_ALIGN

    def take(self, size: int) -> tuple[int, Usage | None]:
        """(offset of a free block of `size` bytes, None), or (-1, the usage that refused it)."""
        ...

    def give_back(self, offset: int, size: int) -> None: ...

    def usage(self) -> Usage: ...


def check_capacity(capacity_bytes: int, config_key: str) -> int:
    """The capacity an arena of `capacity_bytes` gets (rounded up to BLOCK_ALIGN); ValueError naming the
    setting when it is not positive."""
    if capacity_bytes <= 0:
        raise ValueError(f"Arena: capacity_bytes must be positive, got {capacity_bytes}; set {config_key}")
    return _round_up(capacity_bytes, BLOCK_ALIGN)


def _full_message(u: Usage, config_key: str, shape: list[int], dtype: torch.dtype, nbytes: int, block: int) -> str:
    message = (
        f"Arena: cannot allocate a tensor of shape {shape} and dtype {dtype} ({nbytes} bytes, a {block}-byte "
        f"block): capacity {u.capacity} bytes, {u.in_use} in use, largest free block {u.largest_free} bytes"
    )
    if u.capacity - u.in_use >= block:
        message += f" ({u.capacity - u.in_use} bytes free but fragmented into {u.free_blocks} blocks)"
    return message + f". Raise {config_key} (the arena's capacity in bytes)."


def _check_shape(shape: list[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype; ValueError for a negative size, as the compiled class."""
    if any(size < 0 for size in shape):
        raise ValueError(f"Arena.allocate: negative size in shape {shape}")
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    if nbytes >= 1 << 63:
        raise ValueError(f"Arena.allocate: shape {shape} overflows int64 bytes")
    return nbytes


class _FreeList:
    """The fallback's best-fit free list over offsets, shared by a TorchArena and the finalizers of its
    blocks; the same algorithm as csrc/cpu/arena.cpp."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # zeros() writes every page: the pre-touch. BLOCK_ALIGN spare bytes to align the start.
        self.buffer = torch.zeros(capacity + BLOCK_ALIGN, dtype=torch.uint8)
        self.base = _round_up(self.buffer.data_ptr(), BLOCK_ALIGN)
        self.offsets = [0]  # free block starts, ascending
        self.sizes = {0: capacity}  # free block start -> size
        self.in_use = self.peak_in_use = self.allocations = 0
        self.lock = threading.Lock()  # allocate/stats from several threads; never taken by a finalizer
        self.freed: collections.deque[tuple[int, int]] = collections.deque()  # (offset, size) from finalizers

    def largest_free(self) -> int:
        return max(self.sizes.values(), default=0)

    def take(self, size: int) -> tuple[int, Usage | None]:
        """Smallest free block that fits, lowest address among equals."""
        with self.lock:
            self.apply_frees()
            fits = [(block, offset) for offset, block in self.sizes.items() if block >= size]
            if not fits:
                return -1, self._usage()
            block, offset = min(fits)
            self._erase(offset)
            if block > size:
                self._insert(offset + size, block - size)
            self.in_use += size
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            self.allocations += 1
            return offset, None

    def usage(self) -> Usage:
        with self.lock:
            self.apply_frees()
            return self._usage()

    def _usage(self) -> Usage:
        return Usage(
            self.capacity, self.in_use, self.peak_in_use, self.largest_free(), len(self.offsets), self.allocations
        )

    def give_back(self, offset: int, size: int) -> None:
        """A block's storage died (any thread, maybe inside take): queue it for apply_frees."""
        self.freed.append((offset, size))

    def apply_frees(self) -> None:
        """Caller holds lock. Gives back the blocks whose storage died, merging each with its neighbours."""
        while self.freed:
            offset, size = self.freed.popleft()
            self.in_use -= size
            self.allocations -= 1
            i = bisect.bisect_left(self.offsets, offset)
            if i < len(self.offsets) and offset + size == self.offsets[i]:
                size += self._erase(self.offsets[i])
            if i > 0 and self.offsets[i - 1] + self.sizes[self.offsets[i - 1]] == offset:
                offset = self.offsets[i - 1]
                size += self._erase(offset)
            self._insert(offset, size)

    def _insert(self, offset: int, size: int) -> None:
        bisect.insort(self.offsets, offset)
        self.sizes[offset] = size

    def _erase(self, offset: int) -> int:
        self.offsets.pop(bisect.bisect_left(self.offsets, offset))
        return self.sizes.pop(offset)


class BlockArena:
    """Lends blocks of a free list as tensors (see [Note: how the fallback learns that a block is free]);
    the same for the compiled and the fallback free list."""

    def __init__(self, blocks: FreeList, config_key: str) -> None:
        self._blocks = blocks
        self._config_key = config_key

    def allocate(self, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
        tensor, refused = self._lend(sizes, dtype)
        if tensor is None:
            assert refused is not None
            nbytes = _check_shape(sizes, dtype)
            raise RuntimeError(_full_message(refused, self._config_key, sizes, dtype, nbytes, block_bytes(nbytes)))
        return tensor

    def try_allocate(self, sizes: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        return self._lend(sizes, dtype)[0]

    def _lend(self, sizes: list[int], dtype: torch.dtype) -> tuple[torch.Tensor | None, Usage | None]:
        """A block as a tensor, or None and the free list's usage when no free block is large enough."""
        nbytes = _check_shape(sizes, dtype)
        if nbytes == 0:
            return torch.empty(sizes, dtype=dtype), None  # takes no block
        block = block_bytes(nbytes)
        offset, refused = self._blocks.take(block)
        if refused is not None:
            return None, refused
        memory = (ctypes.c_ubyte * nbytes).from_address(self._blocks.base + offset)
        finalizer = weakref.finalize(memory, self._blocks.give_back, offset, block)  # owns the free list
        finalizer.atexit = False  # the whole buffer goes at exit anyway
        return torch.frombuffer(memory, dtype=dtype).view(sizes), None

    def stats(self) -> ArenaStats:
        u = self._blocks.usage()
        free_total = u.capacity - u.in_use
        return ArenaStats(
            capacity=u.capacity,
            in_use=u.in_use,
            peak_in_use=u.peak_in_use,
            largest_free=u.largest_free,
            free_blocks=u.free_blocks,
            allocations=u.allocations,
            fragmentation=1.0 - u.largest_free / free_total if free_total > 0 else 0.0,
        )

    def data_ptr(self) -> int:
        return self._blocks.base


class _CompiledFreeList:
    """csrc/cpu/arena.cpp's buffer and free list (arena.FreeList). The C++ state is freed when this
    object dies: the finalizers of lent blocks hold it (see [Note: how the fallback learns that a block
    is free] in engine/ops/arena.py), so that is after the last block's storage."""

    def __init__(self, lib: ctypes.CDLL, capacity_bytes: int, config_key: str) -> None:
        capacity = check_capacity(capacity_bytes, config_key)
        handle = lib.ze_arena_create(capacity, thread_count())  # pre-touches every page, without the GIL
        if not handle:
            raise RuntimeError(f"Arena: could not allocate {capacity} bytes; lower {config_key}")
        self._lib, self._handle = lib, handle
        self.base: int = lib.ze_arena_base(handle)
        destroy = weakref.finalize(self, lib.ze_arena_destroy, handle)
        destroy.atexit = False  # blocks may still be in use while the interpreter exits: leave the memory

    def take(self, size: int) -> tuple[int, Usage | None]:
        refused = (ctypes.c_int64 * 6)()
        offset = self._lib.ze_arena_take(self._handle, size, refused)
        return (offset, None) if offset >= 0 else (-1, Usage(*refused))

    def give_back(self, offset: int, size: int) -> None:
        self._lib.ze_arena_give_back(self._handle, offset, size)

    def usage(self) -> Usage:
        out = (ctypes.c_int64 * 6)()
        self._lib.ze_arena_usage(self._handle, out)
        return Usage(*out)


class TorchArena(BlockArena):
    """The pure-torch arena: same algorithm, offsets, stats and errors as the compiled one."""

    def __init__(self, capacity_bytes: int, config_key: str) -> None:
        super().__init__(_FreeList(check_capacity(capacity_bytes, config_key)), config_key)


class Arena:
    """Pre-touched contiguous CPU buffer lending best-fit, 64-byte-aligned blocks as tensors.

    capacity_bytes: the buffer's size (rounded up to 64), allocated and written once here.
    config_key: the setting that sizes the arena, named by the error when a request does not fit.
    Thread-safe; blocks may be freed from any thread, and tensors may outlive the Arena.
    """

    def __init__(self, capacity_bytes: int, config_key: str = "capacity_bytes") -> None:
        ext = builder.load()
        self.compiled = ext is not None
        self._impl: BlockArena = (
            BlockArena(_CompiledFreeList(ext.library, int(capacity_bytes), config_key), config_key)
            if ext is not None
            else TorchArena(int(capacity_bytes), config_key)
        )

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor in a free block (contents undefined); RuntimeError when none fits."""
        return self._impl.allocate([int(size) for size in shape], dtype)

    def try_allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """allocate(), or None where no free block is large enough (one search of the free list)."""
        return self._impl.try_allocate([int(size) for size in shape], dtype)

    def stats(self) -> ArenaStats:
        return self._impl.stats()

    def data_ptr(self) -> int:
        """Address of the arena's first byte (blocks lie in [data_ptr, data_ptr + capacity))."""
        return self._impl.data_ptr()
