"""Process groups and collectives: the only module in engine/ that calls torch.distributed.

Everything else goes through these wrappers so that (a) every byte sent is counted for
`comm_stats()`, (b) later backends (a ring reduce-scatter for gloo) slot in one place, and
(c) a test can forbid direct torch.distributed use elsewhere (tests/test_layering.py).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("engine")

ReduceOp = dist.ReduceOp
Work = dist.Work

# Environment variables a launcher (zrun, torchrun, deepspeed) sets for each rank.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class _CommState:
    owns_group: bool = False
    """True when init_distributed created the default group, so destroy() may tear it down."""
    world_size_source: str = "not initialised"
    """Where the world size came from, quoted in batch-size error messages."""
    implicit_group: bool = False
    """True when engine.initialize() created the group (the user never called init_distributed)."""
    engine_refs: int = 0
    """Live engines using an implicit group; the last one to be destroyed tears it down."""
    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    p2p_tag: int = 0
    scratch: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = field(default_factory=dict)
    """Receive buffers of pairwise reduce-scatters, reused (see _scratch)."""


_state = _CommState()


def _mpi_env_to_torch_env() -> None:
    """Map Open MPI / MPICH rank variables to torchrun's names (mpirun without mpi4py)."""
    pairs = (
        ("OMPI_COMM_WORLD_RANK", "RANK"),
        ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
        ("PMI_RANK", "RANK"),
        ("PMI_SIZE", "WORLD_SIZE"),
    )
    for mpi_name, torch_name in pairs:
        if mpi_name in os.environ and torch_name not in os.environ:
            os.environ[torch_name] = os.environ[mpi_name]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: timedelta = timedelta(minutes=30),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group, DeepSpeed-style.

    Reuses an existing group. Otherwise reads torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), or Open MPI's when launched by mpirun. Without any launcher it
    creates a one-process group on an in-memory store, so world size 1 runs the same code path
    as N ranks and no port is opened.
    """
    if dist.is_initialized():
        _state.world_size_source = _state.world_size_source if _state.owns_group else (
            "the process group that already existed when the engine started")
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but no torch.distributed process group exists; "
            "call torch.distributed.init_process_group() first or drop dist_init_required")
    if auto_mpi_discovery:
        _mpi_env_to_torch_env()
    backend = dist_backend or default_backend()
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE"))
    if rank >= 0 and world_size > 0:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timeout)
        _state.world_size_source = "the rank/world_size arguments of init_distributed()"
    elif launched:
        missing = [n for n in _LAUNCH_ENV if n not in os.environ]
        if missing and init_method is None:
            raise RuntimeError(
                f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; start the job with "
                "zrun (or torchrun), or export MASTER_ADDR and MASTER_PORT")
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout)
        _state.world_size_source = f"WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment (launcher)"
    else:
        # A plain `python train.py`: one rank on an in-process store, nothing listens.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _state.world_size_source = "no launcher environment (RANK/WORLD_SIZE unset): a single process"
    _state.owns_group = True
    if verbose and get_rank() == 0:
        logger.info("initialised %s process group: world size %d (%s)", backend, get_world_size(),
                    _state.world_size_source)


def world_size_source() -> str:
    return _state.world_size_source


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_backend() -> str:
    return dist.get_backend()


def _count(op: str, tensor: torch.Tensor, factor: float) -> None:
    """Account the bytes this rank puts on the wire (ring algorithm volumes)."""
    n = get_world_size()
    nbytes = int(tensor.numel() * tensor.element_size() * factor * (n - 1) / max(n, 1))
    _state.bytes_sent[op] = _state.bytes_sent.get(op, 0) + nbytes
    _state.calls[op] = _state.calls.get(op, 0) + 1


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work | None:
    # A ring all-reduce sends 2(N-1)/N of the buffer per rank.
    _count("all_reduce", tensor, 2.0)
    return dist.all_reduce(tensor, op=op, async_op=async_op)


class PairwiseWork:
    """Async handle of a collective built from point-to-point transfers: wait() completes the
    transfers, then runs the local part (the reduction of what arrived), once."""

    def __init__(self, works: list[Work], finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


Handle = Work | PairwiseWork
"""What an async collective returns: wait() on it before touching its buffers."""


def free_buffers() -> None:
    """Drop the cached receive buffers (engine.destroy() calls this)."""
    _state.scratch.clear()


def _use_pairwise() -> bool:
    """gloo's reduce_scatter is an all-reduce plus a slice (2x the bytes) and its all-gather runs
    2.5-3.7x slower than an all-reduce of the same size; direct pairwise exchanges move exactly
    (N-1)/N of the buffer (measured at 2 ranks, 64 MiB: 32 ms and 27 ms against 94 and 96 ms).
    ZERO_ENGINE_NATIVE_COLLECTIVES=1 forces torch's own collectives."""
    return (get_world_size() > 1 and get_backend() == "gloo"
            and os.environ.get("ZERO_ENGINE_NATIVE_COLLECTIVES", "0") != "1")


def _next_tag(op: str, tensor: torch.Tensor, key: int) -> int:
    """A tag that differs between consecutive collectives and between different collectives.

    Every rank issues the same collectives in the same order, so the counters agree. The low bits
    are a checksum of what is exchanged (operation, size, dtype, the caller's key such as a unit
    index): when ranks diverge, mismatched transfers then never pair up and silently exchange
    the wrong buffers; they time out instead (see wait()).
    """
    _state.p2p_tag = (_state.p2p_tag + 1) % (1 << 12)
    signature = zlib.crc32(f"{op}:{tensor.numel()}:{tensor.dtype}:{key}".encode()) & 0xFFFF
    return (_state.p2p_tag << 16) | signature


def collective_timeout() -> float:
    """Seconds a stage waits for one collective before declaring the ranks diverged
    (ZERO_ENGINE_COLLECTIVE_TIMEOUT, default 300: minutes, not torch's 30)."""
    return float(os.environ.get("ZERO_ENGINE_COLLECTIVE_TIMEOUT", "300"))


def wait(handle: Handle, what: str) -> None:
    """Wait for an async collective; past collective_timeout(), fail with a message naming it."""
    limit = collective_timeout()
    try:
        handle.wait(timedelta(seconds=limit))
    except RuntimeError as err:
        raise RuntimeError(
            f"rank {get_rank()}: {what} did not complete within {limit:.0f} s ({err}). The ranks are not "
            "issuing the same collectives: one skipped a forward or backward, ran units in another order, or "
            "stopped; the other ranks' errors say where each was. Set ZERO_ENGINE_COLLECTIVE_TIMEOUT "
            "(seconds) to wait longer.") from err


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable receive buffer (fresh memory pays first-touch page faults on every call)."""
    free = _state.scratch.setdefault((numel, dtype, device), [])
    return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)


def _return_scratch(buf: torch.Tensor) -> None:
    _state.scratch.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   key: int = 0) -> Work | PairwiseWork | None:
    """Sum `input` (world_size equal slices) across ranks; rank r receives slice r in `output`.

    `output` may be rank r's slice of `input` itself (in place). `input` must not be written
    until the collective is waited for.
    """
    # A ring reduce-scatter sends (N-1)/N of the input per rank, as does the pairwise exchange.
    _count("reduce_scatter", input, 1.0)
    if not _use_pairwise() or input.numel() == 0:
        return dist.reduce_scatter_single(output, input, async_op=async_op)
    n, rank = get_world_size(), get_rank()
    chunks = input.view(n, -1)
    if output.data_ptr() != chunks[rank].data_ptr():
        output.copy_(chunks[rank])
    received = _scratch(chunks.shape[1] * (n - 1), input.dtype, input.device).view(n - 1, -1)
    tag = _next_tag("reduce_scatter", input, key)
    works = []
    for k in range(1, n):
        works.append(dist.isend(chunks[(rank + k) % n], (rank + k) % n, tag=tag))
        works.append(dist.irecv(received[k - 1], (rank - k) % n, tag=tag))

    def finish() -> None:
        for k in range(n - 1):
            output.add_(received[k])
        _return_scratch(received.view(-1))

    work = PairwiseWork(works, finish)
    if not async_op:
        work.wait()
        return None
    return work


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
               key: int = 0) -> Work | PairwiseWork | None:
    """Concatenate every rank's `input` into `output` (world_size x input).

    `input` may be rank r's slice of `output` itself (in place, no copy).
    """
    # A ring all-gather sends (N-1)/N of the output per rank, as does the pairwise exchange.
    _count("all_gather", output, 1.0)
    if not _use_pairwise() or output.numel() == 0:
        return dist.all_gather_single(output, input, async_op=async_op)
    n, rank = get_world_size(), get_rank()
    chunks = output.view(n, -1)
    if input.data_ptr() != chunks[rank].data_ptr():
        chunks[rank].copy_(input)
    tag = _next_tag("all_gather", output, key)
    works = []
    for k in range(1, n):
        works.append(dist.isend(chunks[rank], (rank + k) % n, tag=tag))
        works.append(dist.irecv(chunks[(rank - k) % n], (rank - k) % n, tag=tag))
    work = PairwiseWork(works)
    if not async_op:
        work.wait()
        return None
    return work


def broadcast(tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
    _count("broadcast", tensor, 1.0)
    return dist.broadcast(tensor, src=src, async_op=async_op)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (small metadata only: it is pickled)."""
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    dist.barrier()


def comm_stats() -> dict[str, dict[str, int]]:
    """Bytes this rank sent and calls made, per collective, since start (or the last reset)."""
    return {"bytes_sent": dict(_state.bytes_sent), "calls": dict(_state.calls)}


def acquire_process_group(distributed_port: int | None = None, dist_init_required: bool | None = None) -> bool:
    """For engine.initialize(): make sure a group exists. Returns True when the engine must call
    release_process_group() on destroy (the group was created implicitly, for engines only)."""
    if not dist.is_initialized():
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
        _state.implicit_group = True
    if _state.implicit_group:
        _state.engine_refs += 1
    return _state.implicit_group


def release_process_group() -> None:
    _state.engine_refs -= 1
    if _state.engine_refs <= 0 and _state.implicit_group:
        _state.implicit_group = False
        _state.engine_refs = 0
        destroy_process_group()


def destroy_process_group() -> None:
    """Tear down the default group, but only if init_distributed created it."""
    if _state.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _state.owns_group = False
    _state.world_size_source = "not initialised"


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast many tensors in place with one collective per dtype and device.

    Each gloo collective costs about a millisecond of latency here, so a model's hundreds of
    parameters and buffers go as a few flat messages instead of hundreds of small ones.
    """
    if get_world_size() == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        if len(group) == 1 and group[0].is_contiguous():  # no flat copy needed
            with torch.no_grad():
                broadcast(group[0].detach(), src=src)
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast(flat, src=src)
        offset = 0
        for t in group:
            n = t.numel()
            with torch.no_grad():
                t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
