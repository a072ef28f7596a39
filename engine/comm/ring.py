"""Ring reduce-scatter and all-gather on point-to-point transfers, driven by a progress thread.

The alternative to engine/comm/p2p.py's direct exchanges for large groups on thin networks: each rank
talks to two neighbours only (no N-way incast at a switch), sends exactly (N-1)/N of the buffer, and
pays N-1 steps of latency instead of one. Chosen with the config's "collectives": "ring"
(ZERO_ENGINE_COLLECTIVES=ring); with 2 ranks a ring is the pairwise exchange.

- reduce-scatter: at step s (0 .. N-2) rank r sends its running sum of chunk (r-1-s) mod N to rank
  r+1 and receives chunk (r-2-s) mod N from rank r-1, to which it adds its own contribution; after
  N-1 steps it holds the sum of chunk r. Each chunk travels in segments, and a segment is forwarded as
  soon as it is reduced, so the next step's transfer overlaps this step's additions. Chunk r is
  summed in the order r+1, r+2, ..., r-1, r (fixed, so deterministic). Partial sums travel in the wire
  dtype: with a bf16 wire each hop rounds its partial sum to bf16 (the direct exchange rounds each
  contribution once; this is the ring's price, as in NCCL's bf16 rings), the last addition is in
  the output's dtype.
- all-gather: at step s rank r forwards chunk (r-s) mod N to rank r+1, received straight into the
  output, segment by segment.

A ring needs local work between its steps, so the steps run on one background thread per process,
in issue order (the same order on every rank, hence no deadlock): the returned handle's transfers and
additions progress while the caller computes, and wait() only waits. The collective's signature is
exchanged with every peer first (p2p.py's check), so diverged ranks get the same named error.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from engine.comm.p2p import (
    POOL,
    Call,
    P2PWork,
    PendingWork,
    add_into,
    assign,
    open_all_gather,
    open_reduce_scatter,
    split_segments,
)


class _Job:
    """One ring collective: `run` executes on the progress thread; wait() waits for it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.finished = threading.Event()
        self.error: BaseException | None = None


class RingWork:
    """Handle of one ring collective: wait() waits for the progress thread to finish it."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._job.finished.wait(seconds):
            raise RuntimeError(f"ring collective not finished after {seconds:.0f} s")
        if self._job.error is not None:
            raise RuntimeError(str(self._job.error)) from self._job.error
        return True

    def is_completed(self) -> bool:
        return self._job.finished.is_set()


class _Progress:
    """The background thread that runs ring collectives, one at a time, in issue order. After a
    failure every later collective fails with the same error (its transfers can never match up)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failed: BaseException | None = None

    def submit(self, run: Callable[[], None]) -> RingWork:
        job = _Job(run)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # A daemon: a rank that exits with a collective still pending must not hang in exit.
                self._thread = threading.Thread(target=self._loop, name="zero-engine-ring", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return RingWork(job)

    def reset(self) -> None:
        """Forget a failure (the process group it belonged to was destroyed; a new one starts clean)."""
        self._failed = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if self._failed is None:
                try:
                    job.run()
                except BaseException as err:  # noqa: BLE001 - reported to the waiter, never lost here
                    self._failed = err
            job.error = self._failed
            job.finished.set()


PROGRESS = _Progress()


def _run_on_progress_thread(work: P2PWork) -> RingWork:
    """Run `work`'s waits and local steps (p2p.py's P2PWork: signatures checked, then each receive in
    order followed by its step, then the sends, the pool buffers given back) on the progress thread."""

    def run() -> None:
        work.wait()

    return PROGRESS.submit(run)


def reduce_scatter(call: Call, output: torch.Tensor, input: torch.Tensor, wire: torch.dtype) -> RingWork:
    """Start: output = the sum over ranks of slice `rank` of their inputs, summed around the ring (see
    the module docstring)."""
    c, source, _, signatures, release = open_reduce_scatter(call, output, input, wire)
    transport, rank, n = call.transport, call.rank, call.n
    sends: list[PendingWork] = []
    left, right, tag = (rank - 1) % n, (rank + 1) % n, signatures.mine.tag()
    segments = split_segments(c, torch.empty((), dtype=wire).element_size())
    partial = POOL.take((n - 1) * c, wire, input.device).view(n - 1, c)  # step s receives into row s
    release.append(partial.view(-1))
    recvs = [[transport.irecv(partial[s, a:b], left, tag) for a, b in segments] for s in range(n - 1)]
    first = (rank - 1) % n
    sends += [transport.isend(source[first, a:b], right, tag) for a, b in segments]  # step 0: our own
    direct = wire == output.dtype  # finish in the wire buffer, then copy

    def step(s: int, a: int, b: int) -> Callable[[], None]:
        """What arrives at step s, segment [a, b): chunk (rank - 2 - s) mod n's partial sum."""
        got, own = partial[s, a:b], source[(rank - 2 - s) % n, a:b]

        def reduce() -> None:
            if s < n - 2:
                add_into(got, own)
                sends.append(transport.isend(got, right, tag))  # forwarded as soon as it is reduced
            elif direct:
                add_into(got, own)
                output[a:b].copy_(got)
            else:
                assign(output[a:b], got)
                add_into(output[a:b], own)

        return reduce

    steps = [(work, step(s, a, b)) for s in range(n - 1) for (a, b), work in zip(segments, recvs[s])]
    return _run_on_progress_thread(P2PWork(signatures, steps, sends, release))


def all_gather(call: Call, output: torch.Tensor, input: torch.Tensor) -> RingWork:
    """Start: output = every rank's input, in rank order, each chunk forwarded around the ring."""
    c, chunks, signatures = open_all_gather(call, output, input)
    transport, rank, n = call.transport, call.rank, call.n
    sends: list[PendingWork] = []
    left, right, tag = (rank - 1) % n, (rank + 1) % n, signatures.mine.tag()
    segments = split_segments(c, output.element_size())
    recvs = [[transport.irecv(chunks[(rank - 1 - s) % n, a:b], left, tag) for a, b in segments] for s in range(n - 1)]
    sends += [transport.isend(chunks[rank, a:b], right, tag) for a, b in segments]

    def forward(j: int, a: int, b: int) -> Callable[[], None]:
        return lambda: sends.append(transport.isend(chunks[j, a:b], right, tag))

    # A received segment is forwarded to the right, except at the last step (it has gone all round).
    steps = [
        (work, forward((rank - 1 - s) % n, a, b) if s < n - 2 else None)
        for s in range(n - 1)
        for (a, b), work in zip(segments, recvs[s])
    ]
    return _run_on_progress_thread(P2PWork(signatures, steps, sends, []))
