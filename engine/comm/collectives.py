"""The collectives, and the count of every byte they send.

reduce_scatter and all_gather run the engine's own point-to-point schedules on gloo (p2p.py: direct
exchanges, ring.py: rings, through the transports of transport.py) and torch's elsewhere
(collectives_impl); every call is counted for comm_stats() under its op name, or "<group>.<op>" on a
subgroup (groups.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.comm import p2p, ring
from engine.comm.groups import group_rank, group_size, is_world, subgroup
from engine.comm.lifecycle import get_backend, get_rank, get_world_size
from engine.comm.state import STATE
from engine.comm.transport import GroupTransport, TorchTransport

ReduceOp = dist.ReduceOp
Work = dist.Work

# torch 2.13 renamed the flat collectives (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
# -> reduce_scatter_single) and deprecates the old names; torch 2.4-2.12 have only the old ones. Found on a
# GPU machine with torch 2.11, where stages 1-3 failed at their first collective.
ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _count(op: str, tensor: torch.Tensor, factor: float, group: ProcessGroup | None = None) -> None:
    """Account the bytes this rank puts on the wire (ring algorithm volumes); a collective on a group
    made by new_group is counted under "<group name>.<op>"."""
    n = group_size(group)
    _sent(_op_name(op, group), int(tensor.numel() * tensor.element_size() * factor * (n - 1) / max(n, 1)))


def all_gather_list(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every member's `tensor` (same shape and dtype everywhere), in group order."""
    out = [torch.empty_like(tensor) for _ in range(group_size(group))]
    _count("all_gather", tensor, float(group_size(group)), group)
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | ReduceOp.RedOpType = ...,
    group: ProcessGroup | None = ...,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | ReduceOp.RedOpType = ...,
    group: ProcessGroup | None = ...,
    async_op: bool = ...,
) -> Work | None: ...
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    # torch's (and deepspeed.comm's) argument order: (tensor, op, group, async_op).
    # op: a member such as ReduceOp.MAX (a RedOpType in torch's stubs) or a ReduceOp instance.
    # A ring all-reduce sends 2(N-1)/N of the buffer per rank.
    _count("all_reduce", tensor, 2.0, group)
    return dist.all_reduce(tensor, op=op, async_op=async_op, group=group)


class Finish:
    """Async handle of a collective plus a local step after it (a cast or an add), once."""

    def __init__(self, work: Handle, finish: Callable[[], object] | None = None) -> None:
        self._work: Handle | None = work  # None once waited on
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


Handle = Work | p2p.P2PWork | ring.RingWork | Finish | _Done
"""What an async collective returns: wait() on it before touching its buffers."""


def free_buffers() -> None:
    """Drop the cached transfer buffers (engine.destroy() calls this)."""
    p2p.POOL.free.clear()


COLLECTIVES = ("engine", "ring", "native")


def collectives_impl() -> str:
    """Which reduce-scatter/all-gather run: "p2p" (direct exchanges, engine/comm/p2p.py), "ring"
    (engine/comm/ring.py) or "native" (torch's).

    On gloo with more than one rank the engine's own: gloo's reduce_scatter is an all-reduce plus a
    slice (2x the bytes) and its all-gather runs 2.5-3.7x slower than an all-reduce of the same size;
    direct exchanges unless "ring" was chosen with more than two ranks (a ring of two is the direct
    exchange, which needs no progress thread). NCCL and other backends keep their own. The choice is
    the config's "collectives" (set_collectives); the environment overrides it:
    ZERO_ENGINE_COLLECTIVES=engine|ring|native, or ZERO_ENGINE_NATIVE_COLLECTIVES=1 (native's older
    spelling).
    """
    choice = os.environ.get("ZERO_ENGINE_COLLECTIVES", STATE.collectives)
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
    STATE.collectives = choice


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
            "(seconds) to wait longer."
        ) from err


def count_sent(op: str, nbytes: int, group: ProcessGroup | None = None) -> None:
    """Count one call of `op` that put `nbytes` on the wire from this rank, for comm_stats() (under
    "<group name>.<op>" on a subgroup): for the collectives of other modules (torch_style.py, sendrecv.py)."""
    _sent(_op_name(op, group), nbytes)


def _sent(op: str, nbytes: int) -> None:
    STATE.bytes_sent[op] = STATE.bytes_sent.get(op, 0) + int(nbytes)
    STATE.calls[op] = STATE.calls.get(op, 0) + 1


def _next_seq(group: ProcessGroup | None = None) -> int:
    # Every member of a group issues the same point-to-point collectives on it in the same order, so
    # one counter per group agrees among its members.
    if group is None or is_world(group):
        STATE.p2p_seq += 1
        return STATE.p2p_seq
    STATE.group_seq[group] = STATE.group_seq.get(group, 0) + 1
    return STATE.group_seq[group]


def _transport(group: ProcessGroup | None) -> TorchTransport | GroupTransport:
    return TorchTransport() if group is None or is_world(group) else subgroup(group).transport


def _op_name(op: str, group: ProcessGroup | None) -> str:
    return op if group is None or is_world(group) else f"{subgroup(group).name}.{op}"


def _check_sizes(op: str, whole: torch.Tensor, part: torch.Tensor, n: int) -> None:
    if whole.numel() != part.numel() * n:
        raise ValueError(
            f"{op}: the whole buffer has {whole.numel()} elements but the slice {part.numel()} x {n} ranks = "
            f"{part.numel() * n}; the flat layouts pad buffers to a multiple of the world size (engine/zero/layout.py)"
        )
    if not (whole.is_contiguous() and part.is_contiguous()):
        raise ValueError(f"{op}: buffers must be contiguous")


@overload
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    async_op: Literal[True],
    key: int = ...,
    wire_dtype: torch.dtype | None = ...,
    accumulate: bool = ...,
    group: ProcessGroup | None = ...,
) -> Handle: ...
@overload
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    async_op: bool = ...,
    key: int = ...,
    *,
    wire_dtype: torch.dtype | None = ...,
    accumulate: bool = ...,
    group: ProcessGroup | None = ...,
) -> Handle | None: ...
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    async_op: bool = False,
    key: int = 0,
    *,
    wire_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    group: ProcessGroup | None = None,
) -> Handle | None:
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
        schedule = ring if impl == "ring" else p2p
        target = torch.empty_like(output) if accumulate else output  # the sum, added into output after
        call = p2p.Call(_transport(group), group_rank(group), n, _next_seq(group), key)
        started = schedule.reduce_scatter(call, target, input, wire)
        work: Handle = Finish(started, lambda: output.add_(target)) if accumulate else started
    else:
        # gloo emulates it with an all-reduce (2(N-1)/N of the buffer); NCCL runs a real one.
        factor = 2 if get_backend() == "gloo" and n > 1 else 1
        _sent(_op_name("reduce_scatter", group), wire_bytes * factor * (n - 1) // n)
        work = _native_reduce_scatter(output, input, wire, accumulate, group)
    if async_op:
        return work
    work.wait()
    return None


def _native_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, wire: torch.dtype, accumulate: bool, group: ProcessGroup | None
) -> Handle:
    send = input if wire == input.dtype else input.to(wire)
    c = input.numel() // group_size(group)
    # Receive straight into output when it is what the call would produce (a cast input is a copy,
    # so output cannot alias what is sent).
    direct = not accumulate and output.dtype == wire
    target = output if direct else torch.empty(c, dtype=wire, device=input.device)
    work = REDUCE_SCATTER_FLAT(target, send, group=group, async_op=True)
    if direct:
        return Finish(work)
    return Finish(work, (lambda: output.add_(target)) if accumulate else (lambda: output.copy_(target)))


@overload
def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    async_op: Literal[True],
    key: int = ...,
    group: ProcessGroup | None = ...,
) -> Handle: ...
@overload
def all_gather(
    output: torch.Tensor, input: torch.Tensor, async_op: bool = ..., key: int = ..., group: ProcessGroup | None = ...
) -> Handle | None: ...
def all_gather(
    output: torch.Tensor, input: torch.Tensor, async_op: bool = False, key: int = 0, group: ProcessGroup | None = None
) -> Handle | None:
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
        schedule = ring if impl == "ring" else p2p
        call = p2p.Call(_transport(group), group_rank(group), n, _next_seq(group), key)
        work: Handle = schedule.all_gather(call, output, input)
    else:
        work = Finish(ALL_GATHER_FLAT(output, input, group=group, async_op=True))
    if async_op:
        return work
    work.wait()
    return None


@overload
def broadcast(
    tensor: torch.Tensor, src: int = ..., group: ProcessGroup | None = ..., *, async_op: Literal[True]
) -> Work: ...
@overload
def broadcast(
    tensor: torch.Tensor, src: int = ..., group: ProcessGroup | None = ..., async_op: bool = ...
) -> Work | None: ...
def broadcast(
    tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """`src` is a global rank, also with a group (torch's and deepspeed.comm's argument order)."""
    _count("broadcast", tensor, 1.0, group)
    return dist.broadcast(tensor, src=src, async_op=async_op, group=group)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (small metadata only: it is pickled)."""
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None
) -> Work | None:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def comm_stats() -> dict[str, dict[str, int]]:
    """Bytes this rank sent and calls made, per collective, since start (or the last reset)."""
    return {"bytes_sent": dict(STATE.bytes_sent), "calls": dict(STATE.calls)}


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
                t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
