"""DeepSpeed's `aio` section as the parameters of an AioContext (engine/ops/aio.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_THREADS = 64
"""The most I/O threads one AioContext runs, whatever thread_count x queue_depth asks for."""

BACKENDS = ("auto", "compiled", "python")


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's `aio` section as the parameters of an AioContext (its defaults are DeepSpeed's)."""

    block_size: int = 1 << 20
    """Bytes per request: a transfer is cut into blocks of this size, each one pread/pwrite. Larger
    blocks mean fewer system calls; smaller ones spread a single transfer over more threads. A multiple
    of DIRECT_ALIGN keeps every block of an aligned transfer on O_DIRECT."""
    queue_depth: int = 8
    """DeepSpeed: requests in flight per thread (libaio's queue). A thread here has one blocking request
    in flight, so the pool runs `threads` = thread_count x queue_depth threads: DeepSpeed's requests in
    flight, not its thread count (measured, 1 GiB O_DIRECT on this machine's ext4: 1 thread taking 8
    blocks at a time read 1.79 GB/s and wrote 3.0-3.4; 8 threads taking 1 block each, 2.05-2.08 and 4.19)."""
    thread_count: int = 1
    """DeepSpeed's intra_op_parallelism (formerly thread_count): its I/O threads, each with queue_depth
    requests in flight."""
    single_submit: bool = False
    """DeepSpeed: submit requests one at a time instead of in batches (io_submit of one). A thread here
    submits one request at a time anyway, so this is accepted and has no effect."""
    overlap_events: bool = True
    """DeepSpeed: overlap submitting new requests with reaping completed ones. A thread pool has no
    separate submit and reap phases (each thread reaps its own request when the call returns), so this
    is accepted and has no effect; transfers always overlap with the caller."""
    backend: str = "auto"
    """"compiled" (csrc/cpu/aio.cpp), "python" (the fallback) or "auto" (compiled when built)."""

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"aio.{key} must be a positive integer, got {value!r}")
            if value < 1:
                raise ValueError(f"aio.{key} must be a positive integer, got {value!r}")
        for key in ("single_submit", "overlap_events"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"aio.{key} must be true or false, got {getattr(self, key)!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"aio backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    @property
    def threads(self) -> int:
        """I/O threads of the pool: DeepSpeed's requests in flight, thread_count x queue_depth (at most
        MAX_THREADS)."""
        return min(self.thread_count * self.queue_depth, MAX_THREADS)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], backend: str = "auto") -> AioConfig:
        """The config of DeepSpeed's `aio` dict (keys as DeepSpeed spells them; missing ones default).
        ValueError names a key this layer does not know, or intra_op_parallelism and thread_count given
        with different values; use_gds (GPUDirect Storage, CUDA only) must be false."""
        known = {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit"}
        known |= {"overlap_events", "use_gds"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"aio.{unknown[0]}: not a key of DeepSpeed's aio section ({', '.join(sorted(known))})")
        if section.get("use_gds", False):
            raise ValueError("aio.use_gds: GPUDirect Storage needs CUDA; set it to false (or remove it)")
        threads = {section[k] for k in ("intra_op_parallelism", "thread_count") if k in section}
        if len(threads) > 1:
            raise ValueError(
                f"aio.intra_op_parallelism ({section['intra_op_parallelism']}) and aio.thread_count "
                f"({section['thread_count']}) name the same setting; give one"
            )
        fields = {
            k: section[k] for k in ("block_size", "queue_depth", "single_submit", "overlap_events") if k in section
        }
        return cls(**fields, thread_count=threads.pop() if threads else 1, backend=backend)
