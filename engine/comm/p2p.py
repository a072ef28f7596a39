"""Reduce-scatter and all-gather built from point-to-point transfers, for gloo.

gloo's reduce_scatter is an all-reduce plus a slice (twice the bytes, PyTorch PR #118911) and its
all-gather runs 2.5-3.7x slower than an all-reduce of the same size. Here every rank sends exactly
(N-1)/N of the buffer, the minimum (ZeRO paper, section 7), as direct exchanges with every peer:

- reduce-scatter: rank r sends slice p of its input to rank p, in segments; rank r adds each
  arriving segment of slice r into `output` while the next ones are still on the wire. The sum is
  taken in output's dtype in a fixed order (own contribution, then ranks r+1, r+2, ... mod N), so it
  is deterministic, and with a low-precision wire (bf16/fp16 bytes, float32 output) each contribution
  is rounded once at its source and accumulated in float32: the bytes halve, the sum keeps float32
  accuracy. (A ring would round every hop's partial sum to the wire dtype.)
- all-gather: rank r sends its slice to every peer, which receive straight into their output.

Both are one step of latency (a ring takes N-1), move the same bytes as a ring, and return a handle
whose wait() does the local part. Before the payload, every rank sends each peer a small signature
of the collective (sequence number, operation, size, dtypes, key) on a tag of its own; wait() checks
the peers' signatures first, so ranks that issue different collectives get an error naming both
instead of a hang. This module moves bytes through the transport it is given (engine/comm/transport.py:
torch's point-to-point isend/irecv), so it never calls the distributed package itself.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple, Protocol

import torch

from engine.ops.accumulate import accumulate
from engine.ops.checks import SUPPORTED_DTYPES, SUPPORTED_PAIRS
from engine.ops.flatten import copy_into

# A slice is received in up to MAX_SEGMENTS segments of at least SEGMENT_BYTES: the reduction of one
# overlaps the transfer of the next. Each gloo message costs far more than its latency suggests
# (measured at 2 ranks, 32 MiB each way: one message 25 ms, 8 messages 33, 32 messages 34), so a few
# large segments beat many small ones.
# ZERO_ENGINE_SEGMENT_BYTES overrides SEGMENT_BYTES (tests use tiny segments on small buffers).
SEGMENT_BYTES = 4 << 20
MAX_SEGMENTS = 4
_CONTROL_TAG = 1 << 30  # signatures travel on their own tag, matched in issue order per peer
_OPS = {"reduce_scatter": 1, "all_gather": 2}
_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


class PendingWork(Protocol):
    def wait(self, timeout: timedelta = ...) -> bool: ...


class Transport(Protocol):
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingWork: ...
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingWork: ...


class Call(NamedTuple):
    """Which collective one schedule runs, and among whom: the first argument of every schedule here
    and in ring.py (engine/comm/collectives.py makes it)."""

    transport: Transport
    rank: int
    """This rank's position in the group."""
    n: int
    """Ranks in the group."""
    seq: int
    """The collective's number among the group's point-to-point collectives (the same on every rank)."""
    key: int
    """The caller's label of the collective, checked across ranks with the rest of the signature."""


@dataclass(frozen=True)
class Signature:
    """What one collective is, as every rank must agree on it."""

    seq: int
    op: str
    numel: int
    dtype: torch.dtype
    wire: torch.dtype
    key: int

    def pack(self) -> torch.Tensor:
        return torch.tensor(
            [self.seq, _OPS[self.op], self.numel, _DTYPES.index(self.dtype), _DTYPES.index(self.wire), self.key],
            dtype=torch.int64,
        )

    @staticmethod
    def unpack(t: torch.Tensor) -> Signature:
        seq, op, numel, dtype, wire, key = (int(v) for v in t.tolist())
        name = next((k for k, v in _OPS.items() if v == op), f"op{op}")
        return Signature(seq, name, numel, _DTYPES[dtype], _DTYPES[wire], key)

    def describe(self) -> str:
        wire = f", wire {str(self.wire).replace('torch.', '')}" if self.wire != self.dtype else ""
        return (
            f"{self.op}(numel={self.numel}, {str(self.dtype).replace('torch.', '')}{wire}, key={self.key}) "
            f"as its collective #{self.seq}"
        )

    def tag(self) -> int:
        """Payload tag: differs between consecutive collectives and between different ones, so
        transfers of diverged ranks never pair up (the signature check reports them)."""
        checksum = zlib.crc32(f"{self.op}:{self.numel}:{self.dtype}:{self.wire}:{self.key}".encode()) & 0xFFFF
        return ((self.seq % (1 << 12)) << 16) | checksum


@dataclass
class _Pool:
    """Reusable receive/send buffers: fresh memory pays first-touch page faults on every call."""

    free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = field(default_factory=dict)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        bufs = self.free.setdefault((numel, dtype, device), [])
        return bufs.pop() if bufs else torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)


POOL = _Pool()


@dataclass
class Signatures:
    """This collective's signature, sent to every peer, and theirs, being received."""

    rank: int
    mine: Signature
    received: list[tuple[int, PendingWork, torch.Tensor]]
    sent: list[PendingWork]

    def check(self, timeout: timedelta | None = None) -> None:
        """Raise, naming both collectives, if a peer issued another one. Every signature is received
        and ours delivered before comparing, so that every rank gets to read every signature even
        when one raises and tears its connections down."""
        for _, work, _ in self.received:
            _wait(work, timeout)
        for work in self.sent:
            _wait(work, timeout)
        for peer, _, buf in self.received:
            theirs = Signature.unpack(buf)
            if theirs != self.mine:
                raise RuntimeError(
                    f"rank {self.rank} issued {self.mine.describe()} but rank {peer} issued "
                    f"{theirs.describe()}: the ranks are not issuing the same collectives (one skipped a "
                    f"forward or backward, ran units in another order, or took another code path)"
                )


class P2PWork:
    """Handle of one point-to-point collective. wait() checks the peers' signatures, then waits for
    each receive in order and runs its local step (an accumulation), then the sends; once."""

    def __init__(
        self,
        signatures: Signatures,
        steps: Sequence[tuple[PendingWork, Callable[[], None] | None]],
        sends: list[PendingWork],
        release: list[torch.Tensor],
    ) -> None:
        self._signatures, self._steps, self._sends, self._release = signatures, steps, sends, release
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        try:
            self._signatures.check(timeout)
        except RuntimeError:
            self._done = True  # the payload transfers of this collective can never complete
            raise
        for work, step in self._steps:
            _wait(work, timeout)
            if step is not None:
                step()
        for work in self._sends:
            _wait(work, timeout)
        for buf in self._release:
            POOL.give(buf)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _wait(work: PendingWork, timeout: timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def split_segments(numel: int, element_size: int) -> list[tuple[int, int]]:
    """[0, numel) in up to MAX_SEGMENTS pieces of at least SEGMENT_BYTES."""
    segment_bytes = int(os.environ.get("ZERO_ENGINE_SEGMENT_BYTES", str(SEGMENT_BYTES)))
    step = max(1, segment_bytes // element_size, -(-numel // MAX_SEGMENTS))
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src, cast in one fused pass where the dtypes differ (torch's cast runs 5-10x slower)."""
    if dst.dtype != src.dtype and dst.dtype in SUPPORTED_DTYPES and src.dtype in SUPPORTED_DTYPES:
        copy_into(dst, [src], [0])
    else:
        dst.copy_(src)


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src in float32 math, rounded once into dst (the fused op where it applies)."""
    if (dst.dtype, src.dtype) in SUPPORTED_PAIRS:
        accumulate(dst, src)
    else:  # float64, integers: torch's add is exact enough and not worth a kernel
        dst.add_(src)


def exchange_signatures(call: Call, mine: Signature) -> Signatures:
    transport, rank, n = call.transport, call.rank, call.n
    packed = mine.pack()
    received, sent = [], []
    for k in range(1, n):
        src = (rank - k) % n
        buf = torch.empty(6, dtype=torch.int64)
        received.append((src, transport.irecv(buf, src, _CONTROL_TAG), buf))
        sent.append(transport.isend(packed, (rank + k) % n, _CONTROL_TAG))
    return Signatures(rank, mine, received, sent)


class ReduceScatterStart(NamedTuple):
    c: int
    """Elements per rank."""
    source: torch.Tensor
    """(n, c): what this rank contributes, in the wire dtype (the input itself, or a cast copy)."""
    in_place: bool
    """output is this rank's slice of the input."""
    signatures: Signatures
    release: list[torch.Tensor]
    """Pool buffers to give back when the collective is done."""


def open_reduce_scatter(call: Call, output: torch.Tensor, input: torch.Tensor, wire: torch.dtype) -> ReduceScatterStart:
    """What every reduce-scatter schedule does first: check the arguments, send the signature, and
    round every contribution (this rank's own included) to the wire dtype once."""
    n = call.n
    c = input.numel() // n
    chunks = input.view(n, c)
    in_place = output.data_ptr() == chunks[call.rank].data_ptr() and output.dtype == input.dtype
    signatures = exchange_signatures(
        call, Signature(call.seq, "reduce_scatter", input.numel(), input.dtype, wire, call.key)
    )
    if wire == input.dtype:
        return ReduceScatterStart(c, chunks, in_place, signatures, [])
    cast = POOL.take(n * c, wire, input.device)
    assign(cast, input.view(-1))
    return ReduceScatterStart(c, cast.view(n, c), in_place, signatures, [cast])


def open_all_gather(call: Call, output: torch.Tensor, input: torch.Tensor) -> tuple[int, torch.Tensor, Signatures]:
    """What every all-gather schedule does first: put this rank's input in place, send the signature.
    Returns (elements per rank, output viewed as (n, c), the signatures)."""
    c = output.numel() // call.n
    chunks = output.view(call.n, c)
    if input.data_ptr() != chunks[call.rank].data_ptr():
        chunks[call.rank].copy_(input.view(-1))
    mine = Signature(call.seq, "all_gather", output.numel(), output.dtype, output.dtype, call.key)
    return c, chunks, exchange_signatures(call, mine)


def reduce_scatter(call: Call, output: torch.Tensor, input: torch.Tensor, wire: torch.dtype) -> P2PWork:
    """Start: output = the sum over ranks of slice `rank` of their inputs, each contribution rounded
    to `wire`, summed in output's dtype. See the module docstring."""
    c, source, in_place, signatures, release = open_reduce_scatter(call, output, input, wire)
    transport, rank, n = call.transport, call.rank, call.n
    mine = signatures.mine
    sends: list[PendingWork] = []
    received = POOL.take((n - 1) * c, wire, input.device).view(n - 1, c)
    release.append(received.view(-1))
    tag = mine.tag()
    segments = split_segments(c, torch.empty((), dtype=wire).element_size())
    peers_in = [(rank + k) % n for k in range(1, n)]  # the summation order after our own slice
    recvs: dict[tuple[int, int], PendingWork] = {}
    for j, (a, b) in enumerate(segments):  # segment-major: every peer's first segment arrives first
        for k, src in enumerate(peers_in):
            recvs[j, k] = transport.irecv(received[k, a:b], src, tag)
        for k in range(1, n):
            dst = (rank - k) % n  # the ranks that list us k-th receive from us in the same order
            sends.append(transport.isend(source[dst, a:b], dst, tag))

    # Our own contribution goes in first, while the transfers run.
    own = source[rank]
    if not in_place:
        assign(output, own)
    elif wire != input.dtype:
        assign(output, own)  # the wire-rounded value, as every peer's contribution is

    def step(k: int, a: int, b: int) -> Callable[[], None]:
        return lambda: add_into(output[a:b], received[k, a:b])

    steps = [(recvs[j, k], step(k, a, b)) for j, (a, b) in enumerate(segments) for k in range(n - 1)]
    return P2PWork(signatures, steps, sends, release)


def all_gather(call: Call, output: torch.Tensor, input: torch.Tensor) -> P2PWork:
    """Start: output = every rank's input, in rank order, received straight into output."""
    _, chunks, signatures = open_all_gather(call, output, input)
    transport, rank, n = call.transport, call.rank, call.n
    sends: list[PendingWork] = []
    tag = signatures.mine.tag()
    steps: list[tuple[PendingWork, Callable[[], None] | None]] = []
    for k in range(1, n):
        steps.append((transport.irecv(chunks[(rank - k) % n], (rank - k) % n, tag), None))
        sends.append(transport.isend(chunks[rank], (rank + k) % n, tag))
    return P2PWork(signatures, steps, sends, [])
