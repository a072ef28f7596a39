"""Process groups and collectives: the only module in engine/ that calls torch.distributed.

Everything else goes through these wrappers so that (a) every byte sent is counted for
`comm_stats()`, (b) later backends (a ring reduce-scatter for gloo) slot in one place, and
(c) a test can forbid direct torch.distributed use elsewhere (tests/test_layering.py).
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine import comm_p2p, comm_ring
from engine.accelerator import get_accelerator

logger = logging.getLogger("engine")

ReduceOp = dist.ReduceOp
Work = dist.Work

# Environment variables a launcher (zrun, torchrun, deepspeed) sets for each rank.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# torch 2.13 renamed the flat collectives (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
# -> reduce_scatter_single) and deprecates the old names; torch 2.4-2.12 have only the old ones. Found on a
# GPU machine with torch 2.11, where stages 1-3 failed at their first collective.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Subgroup:
    name: str
    """What its traffic is counted under in comm_stats(): "<name>.<op>"."""
    transport: _GroupTransport
    """Point-to-point calls addressed by position in the group (it holds the members' global ranks)."""


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
    link: LinkSpeed | None = None
    """measure_link()'s result, measured once per process group."""
    collectives: str = "engine"
    """The config's "collectives": "engine", "ring" or "native" (set_collectives)."""
    p2p_seq: int = 0
    """Point-to-point collectives issued so far (engine/comm_p2p.py): the same count on every rank."""
    store: Any = None
    """The launch environment's rendezvous store, kept for the process's life (see _init_from_env)."""
    store_key: tuple[str, ...] = ()
    """The environment `store` was made for (a different MASTER_PORT makes a new one)."""
    groups_made: int = 0
    """Groups created on `store` so far: the next group's key prefix (the same count on every rank)."""
    subgroups: dict[ProcessGroup, _Subgroup] = field(default_factory=dict)
    """Subgroups made by new_group: their name and members."""
    generation: int = 0
    """Default groups destroyed so far: subgroups made under an older generation are dead."""
    group_seq: dict[ProcessGroup, int] = field(default_factory=dict)
    """Point-to-point collectives issued on each subgroup (as p2p_seq for the world)."""


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
    # The device decision (DS_ACCELERATOR, else CUDA when available) lives in engine/accelerator.py.
    return get_accelerator().communication_backend_name()


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
        if init_method is None:
            _init_from_env(backend, timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, timeout=timeout)
        _state.world_size_source = f"WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment (launcher)"
    else:
        # A plain `python train.py`: one rank on an in-process store, nothing listens.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _state.world_size_source = "no launcher environment (RANK/WORLD_SIZE unset): a single process"
    _state.owns_group = True
    _register_teardown()
    if verbose and get_rank() == 0:
        logger.info("initialised %s process group: world size %d (%s)", backend, get_world_size(),
                    _state.world_size_source)


def _teardown_at_exit() -> None:
    """Destroy the default process group while the interpreter is whole, whoever made it.

    Left to interpreter shutdown, a gloo worker thread can still be releasing the last collective's
    work object (HF's gather_for_metrics all-gather) when Python finalizes; it needs the GIL to drop
    the tensors' Python objects, gets pthread_exit instead, and the rank aborts after its work is done
    ("terminate called without an active exception", exit 134: 1 run in 5 of Trainer's ZeRO-3
    evaluation at 2 ranks; 0 in 15 with the group destroyed first). Nothing can use a group after
    the interpreter starts exiting, so destroying one the application made is safe here. A group
    destroyed earlier (engine.destroy()) can still be alive through a reference cycle and hit the same
    abort at shutdown (tests/zrun_scripts/train_losses.py at 4 ranks: 3 runs in 25), so a garbage
    collection here frees it while Python can still run its threads' releases (0 in 35 after)."""
    if dist.is_initialized():
        if _state.owns_group:
            destroy_process_group()
        else:
            dist.destroy_process_group()
    _state.store = None
    gc.collect()  # a destroyed group that something still references goes now, not during shutdown


def _register_teardown() -> None:
    atexit.unregister(_teardown_at_exit)  # once, however many groups or engines the process makes
    atexit.register(_teardown_at_exit)


def _init_from_env(backend: str, timeout: timedelta) -> None:
    """init_process_group from the launcher's environment, on a store kept for the process's life.

    # [Note: one rendezvous store per process]
    # torch's env:// rendezvous is not repeatable across ranks: each new group writes its keys
    # (gloo's addresses, barriers) under the same names in the same store (zrun's and torchrun's
    # agent store outlives the group), so a rank that destroyed its group and created the next one
    # before a slower peer destroyed its own read that peer's *old* addresses and failed or hung
    # (a retried initialize, a destroy/initialize loop at 2 ranks: half the runs). Here the store is
    # made once per launch environment and each group gets its own key prefix, numbered the same on
    # every rank (every rank creates and destroys groups in the same order), so a group's keys are
    # only ever read by members of that same group.
    """
    key = tuple(os.environ.get(n, "") for n in (*_LAUNCH_ENV, "TORCHELASTIC_RUN_ID"))
    if _state.store is None or _state.store_key != key:
        _state.store, _state.store_key = next(dist.rendezvous("env://", timeout=timeout))[0], key
        _state.groups_made = 0
    _state.groups_made += 1
    store = dist.PrefixStore(f"zero_engine/group{_state.groups_made}/", _state.store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


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


def _count(op: str, tensor: torch.Tensor, factor: float, group: ProcessGroup | None = None) -> None:
    """Account the bytes this rank puts on the wire (ring algorithm volumes); a collective on a group
    made by new_group is counted under "<group name>.<op>"."""
    n = group_size(group)
    _sent(_op_name(op, group), int(tensor.numel() * tensor.element_size() * factor * (n - 1) / max(n, 1)))


# ------------------------------------------------------------------ subgroups (tensor x data parallel)
def new_group(ranks: Sequence[int], name: str) -> ProcessGroup:
    """A process group of the given global ranks, whose traffic comm_stats() counts under
    "<name>.<op>". Every rank of the world must make every group, in the same order (torch's rule),
    also the groups it is not in; it gets back a group it cannot use then."""
    members = sorted(ranks)
    group = dist.new_group(ranks=members)
    _state.subgroups[group] = _Subgroup(name, _GroupTransport(members))
    return group


def adopt_group(group: ProcessGroup, name: str) -> None:
    """Record a group this module did not make (a user's mpu made it with torch.distributed.new_group),
    so collectives on it work on every implementation and comm_stats() counts its traffic under
    "<name>.<op>". A group made by new_group keeps its name."""
    if group not in _state.subgroups:
        _state.subgroups[group] = _Subgroup(name, _GroupTransport(list(dist.get_process_group_ranks(group))))


def _subgroup(group: ProcessGroup) -> _Subgroup:
    if group not in _state.subgroups:
        adopt_group(group, "group")
    return _state.subgroups[group]


def generation() -> int:
    """Changes whenever destroy_process_group() ends the default group (and with it every subgroup)."""
    return _state.generation


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in `group` (None: the world)."""
    return get_world_size() if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's position in `group` (None: its global rank)."""
    return get_rank() if group is None else dist.get_rank(group)


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group`, in group order."""
    return list(range(get_world_size())) if group is None else list(_subgroup(group).transport.ranks)


def all_gather_list(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every member's `tensor` (same shape and dtype everywhere), in group order."""
    out = [torch.empty_like(tensor) for _ in range(group_size(group))]
    _count("all_gather", tensor, float(group_size(group)), group)
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


@overload
def all_reduce(tensor: torch.Tensor, op: ReduceOp | ReduceOp.RedOpType = ..., *, async_op: Literal[True],
               group: ProcessGroup | None = ...) -> Work: ...
@overload
def all_reduce(tensor: torch.Tensor, op: ReduceOp | ReduceOp.RedOpType = ..., async_op: bool = ...,
               group: ProcessGroup | None = ...) -> Work | None: ...
def all_reduce(tensor: torch.Tensor, op: ReduceOp | ReduceOp.RedOpType = ReduceOp.SUM,
               async_op: bool = False, group: ProcessGroup | None = None) -> Work | None:
    # op: a member such as ReduceOp.MAX (a RedOpType in torch's stubs) or a ReduceOp instance.
    # A ring all-reduce sends 2(N-1)/N of the buffer per rank.
    _count("all_reduce", tensor, 2.0, group)
    return dist.all_reduce(tensor, op=op, async_op=async_op, group=group)


class _TorchTransport:
    """torch.distributed's point-to-point calls, for engine/comm_p2p.py."""

    @staticmethod
    def isend(tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _issued(dist.isend(tensor, peer, tag=tag), "isend")

    @staticmethod
    def irecv(tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _issued(dist.irecv(tensor, peer, tag=tag), "irecv")


def _issued(work: Work | None, op: str) -> Work:
    # torch returns no handle only to a rank outside the group, and these calls use the default
    # group, which holds every rank.
    if work is None:
        raise RuntimeError(f"torch.distributed.{op} returned no handle: rank {get_rank()} is not in the default "
                           "process group")
    return work


class _Finish:
    """Async handle of a collective plus a local step after it (a cast or an add), once."""

    def __init__(self, work: Work | comm_p2p.P2PWork | comm_ring.RingWork,
                 finish: Callable[[], object] | None = None) -> None:
        self._work: Work | comm_p2p.P2PWork | comm_ring.RingWork | None = work  # None once waited on
        self._finish = finish  # called once, after the collective; its result is unused

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


class _Done:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


Handle = Work | comm_p2p.P2PWork | comm_ring.RingWork | _Finish | _Done
"""What an async collective returns: wait() on it before touching its buffers."""


def free_buffers() -> None:
    """Drop the cached transfer buffers (engine.destroy() calls this)."""
    comm_p2p.POOL.free.clear()


COLLECTIVES = ("engine", "ring", "native")


def collectives_impl() -> str:
    """Which reduce-scatter/all-gather run: "p2p" (direct exchanges, engine/comm_p2p.py), "ring"
    (engine/comm_ring.py) or "native" (torch's).

    On gloo with more than one rank the engine's own: gloo's reduce_scatter is an all-reduce plus a
    slice (2x the bytes) and its all-gather runs 2.5-3.7x slower than an all-reduce of the same size;
    direct exchanges unless "ring" was chosen with more than two ranks (a ring of two is the direct
    exchange, which needs no progress thread). NCCL and other backends keep their own. The choice is
    the config's "collectives" (set_collectives); the environment overrides it:
    ZERO_ENGINE_COLLECTIVES=engine|ring|native, or ZERO_ENGINE_NATIVE_COLLECTIVES=1 (native's older
    spelling).
    """
    choice = os.environ.get("ZERO_ENGINE_COLLECTIVES", _state.collectives)
    if os.environ.get("ZERO_ENGINE_NATIVE_COLLECTIVES", "0") == "1":
        choice = "native"
    if choice not in COLLECTIVES:
        raise ValueError(f"ZERO_ENGINE_COLLECTIVES={choice!r}: expected one of {', '.join(COLLECTIVES)}")
    n = get_world_size()
    if n > 1 and get_backend() == "gloo" and choice != "native":
        return "ring" if choice == "ring" and n > 2 else "p2p"  # two ranks: a ring is the pairwise exchange
    return "native"


def set_collectives(choice: str) -> None:
    """The config's "collectives" key (for this process: the setting of the engine initialised last;
    every rank must choose the same)."""
    if choice not in COLLECTIVES:
        raise ValueError(f"collectives={choice!r}: expected one of {', '.join(COLLECTIVES)}")
    _state.collectives = choice


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
        if "the ranks are not issuing the same collectives" in str(err):
            raise RuntimeError(f"{what}: {err}") from err
        raise RuntimeError(
            f"rank {get_rank()}: {what} did not complete within {limit:.0f} s ({err}). The ranks are not "
            "issuing the same collectives: one skipped a forward or backward, ran units in another order, or "
            "stopped; the other ranks' errors say where each was. Set ZERO_ENGINE_COLLECTIVE_TIMEOUT "
            "(seconds) to wait longer.") from err


def _sent(op: str, nbytes: int) -> None:
    _state.bytes_sent[op] = _state.bytes_sent.get(op, 0) + int(nbytes)
    _state.calls[op] = _state.calls.get(op, 0) + 1


def _next_seq(group: ProcessGroup | None = None) -> int:
    # Every member of a group issues the same point-to-point collectives on it in the same order, so
    # one counter per group agrees among its members.
    if group is None:
        _state.p2p_seq += 1
        return _state.p2p_seq
    _state.group_seq[group] = _state.group_seq.get(group, 0) + 1
    return _state.group_seq[group]


class _GroupTransport:
    """Point-to-point calls addressed by position in a group (what engine/comm_p2p.py speaks)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        """Global ranks, in group order."""

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _TorchTransport.isend(tensor, self.ranks[peer], tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return _TorchTransport.irecv(tensor, self.ranks[peer], tag)


def _transport(group: ProcessGroup | None) -> _TorchTransport | _GroupTransport:
    return _TorchTransport() if group is None else _subgroup(group).transport


def _op_name(op: str, group: ProcessGroup | None) -> str:
    return op if group is None else f"{_subgroup(group).name}.{op}"


def _check_sizes(op: str, whole: torch.Tensor, part: torch.Tensor, n: int) -> None:
    if whole.numel() != part.numel() * n:
        raise ValueError(
            f"{op}: the whole buffer has {whole.numel()} elements but the slice {part.numel()} x {n} ranks = "
            f"{part.numel() * n}; the flat layouts pad buffers to a multiple of the world size (engine/zero/layout.py)")
    if not (whole.is_contiguous() and part.is_contiguous()):
        raise ValueError(f"{op}: buffers must be contiguous")


@overload
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True], key: int = ...,
                   wire_dtype: torch.dtype | None = ..., accumulate: bool = ...,
                   group: ProcessGroup | None = ...) -> Handle: ...
@overload
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = ..., key: int = ..., *,
                   wire_dtype: torch.dtype | None = ..., accumulate: bool = ...,
                   group: ProcessGroup | None = ...) -> Handle | None: ...
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False, key: int = 0, *,
                   wire_dtype: torch.dtype | None = None, accumulate: bool = False,
                   group: ProcessGroup | None = None) -> Handle | None:
    """Sum `input` (group-size equal slices) across the group (None: every rank); the member at group
    position r receives slice r in `output`.

    `output` may be rank r's slice of `input` itself (in place), or a tensor of another dtype (the sum is
    taken in output's dtype: float32 output from bf16 gradients sums in float32). `wire_dtype` (default:
    input's dtype) is what travels: bf16 halves the bytes of a float32 input and each contribution is
    rounded to it once. `accumulate` adds the sum, rounded to output's dtype once, to what output holds
    instead of overwriting it: `output += reduce(...)`, DeepSpeed's order for gradient accumulation
    (round(acc + round(a + b)) in bf16, never round(round(acc + a) + b)). `input` must not be touched
    until the handle is waited for; its contents are unchanged only when the wire dtype is its own and
    output is not its slice.
    """
    n = group_size(group)
    wire = wire_dtype or input.dtype
    _check_sizes("reduce_scatter", input, output, n)
    if input.numel() == 0:
        return _Done() if async_op else None
    wire_bytes = input.numel() * torch.empty((), dtype=wire).element_size()
    impl = collectives_impl()
    if impl != "native":
        _sent(_op_name("reduce_scatter", group), wire_bytes * (n - 1) // n)
        schedule = comm_ring if impl == "ring" else comm_p2p
        target = torch.empty_like(output) if accumulate else output  # the sum, added into output after
        started = schedule.reduce_scatter(_transport(group), target, input, rank=group_rank(group), n=n,
                                          seq=_next_seq(group), key=key, wire=wire)
        work: Handle = _Finish(started, lambda: output.add_(target)) if accumulate else started
    else:
        # gloo emulates it with an all-reduce (2(N-1)/N of the buffer); NCCL runs a real one.
        factor = 2 if get_backend() == "gloo" and n > 1 else 1
        _sent(_op_name("reduce_scatter", group), wire_bytes * factor * (n - 1) // n)
        work = _native_reduce_scatter(output, input, wire, accumulate, group)
    if async_op:
        return work
    work.wait()
    return None


def _native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, wire: torch.dtype, accumulate: bool,
                           group: ProcessGroup | None) -> Handle:
    send = input if wire == input.dtype else input.to(wire)
    c = input.numel() // group_size(group)
    # Receive straight into output when it is what the call would produce (a cast input is a copy,
    # so output cannot alias what is sent).
    direct = not accumulate and output.dtype == wire
    target = output if direct else torch.empty(c, dtype=wire, device=input.device)
    work = _REDUCE_SCATTER_FLAT(target, send, group=group, async_op=True)
    if direct:
        return _Finish(work)
    return _Finish(work, (lambda: output.add_(target)) if accumulate else (lambda: output.copy_(target)))


@overload
def all_gather(output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True], key: int = ...,
               group: ProcessGroup | None = ...) -> Handle: ...
@overload
def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = ..., key: int = ...,
               group: ProcessGroup | None = ...) -> Handle | None: ...
def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False, key: int = 0,
               group: ProcessGroup | None = None) -> Handle | None:
    """Concatenate every group member's `input` into `output` (group size x input, group order; None:
    every rank).

    `input` may be rank r's slice of `output` itself (in place, no copy).
    """
    n = group_size(group)
    _check_sizes("all_gather", output, input, n)
    if output.numel() == 0:
        return _Done() if async_op else None
    # Ring and direct all-gathers both send (N-1)/N of the output per rank.
    _sent(_op_name("all_gather", group), output.numel() * output.element_size() * (n - 1) // n)
    impl = collectives_impl()
    if impl != "native":
        schedule = comm_ring if impl == "ring" else comm_p2p
        work: Handle = schedule.all_gather(_transport(group), output, input, rank=group_rank(group), n=n,
                                           seq=_next_seq(group), key=key)
    else:
        work = _Finish(_ALL_GATHER_FLAT(output, input, group=group, async_op=True))
    if async_op:
        return work
    work.wait()
    return None


@dataclass(frozen=True)
class LinkSpeed:
    """What one collective costs on this group: a fixed latency plus bytes over a bandwidth."""

    latency_s: float
    bandwidth_Bps: float
    """Bytes per second one rank moves in a reduce-scatter (its (N-1)/N share over the time)."""
    rejected: str | None = None
    """Why the measurement cannot be trusted (then bucket_bytes() is FALLBACK_BUCKET_BYTES), or None."""

    @classmethod
    def from_probe(cls, latency_s: float, moved_bytes: float, transfer_s: float) -> LinkSpeed:
        """Judge one probe: a reduce-scatter moving `moved_bytes` per rank took `transfer_s`.

        A transfer not clearly longer than the latency says nothing about bandwidth: dividing by their
        difference gave 2097 GB/s once (a 4 MiB probe over a clamped 1 us), and the bucket jumped from
        4.8 MiB to 256 MiB between two runs of one job. Such a probe, or a bandwidth no interconnect
        has, is rejected with its reason.
        """
        bandwidth = moved_bytes / (transfer_s - latency_s) if transfer_s > latency_s else math.inf
        problem = None
        if not (math.isfinite(latency_s) and latency_s > 0 and math.isfinite(transfer_s)):
            problem = f"latency {latency_s!r} s, transfer {transfer_s!r} s"
        elif transfer_s < PROBE_OVER_LATENCY * latency_s:
            problem = (f"{moved_bytes / 2**20:.1f} MiB moved in {transfer_s * 1e6:.0f} us, not clearly longer than "
                       f"one collective's latency ({latency_s * 1e6:.0f} us)")
        elif bandwidth > PLAUSIBLE_MAX_BANDWIDTH_BPS:
            problem = f"{bandwidth / 1e9:.0f} GB/s per rank, more than any interconnect"
        return cls(latency_s, bandwidth, problem)

    def bucket_bytes(self) -> int:
        """The bucket for which the fixed latency is LATENCY_SHARE of a collective's time: smaller
        buckets pay mostly latency, larger ones delay the first reduction (less overlap with backward)."""
        if self.rejected is not None:
            return FALLBACK_BUCKET_BYTES
        raw = self.latency_s * self.bandwidth_Bps * (1 - LATENCY_SHARE) / LATENCY_SHARE
        return int(min(max(raw, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES))

    def reason(self) -> str:
        """Why bucket_bytes() is what it is, for the log line."""
        if self.rejected is not None:
            return (f"the link measurement was implausible ({self.rejected}), so the fallback "
                    f"{FALLBACK_BUCKET_BYTES >> 20} MiB")
        raw = self.latency_s * self.bandwidth_Bps * (1 - LATENCY_SHARE) / LATENCY_SHARE
        bound = (f", raised to the {MIN_BUCKET_BYTES >> 20} MiB minimum" if raw < MIN_BUCKET_BYTES else
                 f", cut to the {MAX_BUCKET_BYTES >> 20} MiB maximum" if raw > MAX_BUCKET_BYTES else "")
        return (f"from the measured link: latency {self.latency_s * 1e6:.0f} us, {self.bandwidth_Bps / 1e9:.2f} GB/s "
                f"per rank ({(1 - LATENCY_SHARE) / LATENCY_SHARE:.0f}x the latency's worth of bytes{bound})")


LATENCY_SHARE = 0.05
MIN_BUCKET_BYTES, MAX_BUCKET_BYTES = 1 << 20, 256 << 20
FALLBACK_BUCKET_BYTES = 16 << 20
"""The bucket when no probe could be trusted: between what this formula gives on gloo over loopback
(3-8 MiB) and on NVLink-class links (tens of MiB)."""
PROBE_OVER_LATENCY = 2.0
"""A probe must take at least this many latencies, or it measured noise."""
PLAUSIBLE_MAX_BANDWIDTH_BPS = 1e12
"""Per-rank bytes per second above every interconnect (NVLink 4: 450 GB/s each way)."""
_PROBE_BYTES = (4 << 20, 16 << 20, 64 << 20)
"""Probe sizes tried in turn until one is long enough to time (most links: the first)."""


def measure_link() -> LinkSpeed:
    """Measure the group's collective latency and bandwidth once (a few ms; every rank must call it,
    at the same point). Every rank gets the same numbers (the slowest rank's), so decisions taken
    from them (bucket sizes, hence layouts) agree across ranks; a probe too short to time is
    repeated larger, and a measurement no probe could make plausible says so in `rejected`."""
    if _state.link is not None:
        return _state.link
    saved = dict(_state.bytes_sent), dict(_state.calls)  # the probe is not the user's traffic
    tiny = torch.zeros(1)
    all_reduce(tiny)  # warm-up: the first collective on a pair pays its connection setup
    lat = []
    for _ in range(8):
        t0 = time.perf_counter()
        all_reduce(tiny)
        lat.append(time.perf_counter() - t0)
    latency = sorted(lat)[len(lat) // 2]
    for probe_bytes in _PROBE_BYTES:
        link = _probe(latency, probe_bytes)
        if link.rejected is None:
            break
    free_buffers()  # the probes' receive buffers are not the training's sizes
    _state.link = link
    _state.bytes_sent, _state.calls = saved
    return link


def _probe(latency: float, probe_bytes: int) -> LinkSpeed:
    n = get_world_size()
    out = torch.empty(probe_bytes // 4 // n)
    probe = torch.zeros(out.numel() * n)
    reduce_scatter(out, probe)  # warm-up: buffers of this size
    big = []
    for _ in range(3):
        t0 = time.perf_counter()
        reduce_scatter(out, probe)
        big.append(time.perf_counter() - t0)
    # Every rank judges the same (slowest) numbers, so all take the same branch in measure_link.
    agreed = torch.tensor([latency, min(big)], dtype=torch.float64)
    all_reduce(agreed, op=ReduceOp.MAX)
    return LinkSpeed.from_probe(float(agreed[0]), probe.numel() * 4 * (n - 1) / n, float(agreed[1]))


@overload
def broadcast(tensor: torch.Tensor, src: int = ..., *, async_op: Literal[True],
              group: ProcessGroup | None = ...) -> Work: ...
@overload
def broadcast(tensor: torch.Tensor, src: int = ..., async_op: bool = ...,
              group: ProcessGroup | None = ...) -> Work | None: ...
def broadcast(tensor: torch.Tensor, src: int = 0, async_op: bool = False,
              group: ProcessGroup | None = None) -> Work | None:
    """`src` is a global rank, also with a group."""
    _count("broadcast", tensor, 1.0, group)
    return dist.broadcast(tensor, src=src, async_op=async_op, group=group)


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
    _register_teardown()
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
    _state.link, _state.p2p_seq = None, 0  # a new group is measured and counted afresh
    _state.subgroups.clear()  # subgroups end with the default group
    _state.group_seq.clear()
    _state.generation += 1
    comm_ring.PROGRESS.reset()
    _state.owns_group = False
    _state.world_size_source = "not initialised"


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, process_group: ProcessGroup | None = None) -> None:
    """Broadcast many tensors in place with one collective per dtype and device, from global rank `src`
    to `process_group` (None: every rank).

    Each gloo collective costs about a millisecond of latency here, so a model's hundreds of
    parameters and buffers go as a few flat messages instead of hundreds of small ones.
    """
    if group_size(process_group) == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        if len(same) == 1 and same[0].is_contiguous():  # no flat copy needed
            with torch.no_grad():
                broadcast(same[0].detach(), src=src, group=process_group)
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        broadcast(flat, src=src, group=process_group)
        offset = 0
        for t in same:
            n = t.numel()
            with torch.no_grad():
                t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
