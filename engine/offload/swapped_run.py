"""One swapped optimizer step over its sub-groups, through the swap's few host buffers ([Note: the
swapped step] in engine/offload/optimizer_swap.py): read a sub-group into a free buffer (the next one's
read started ahead with pipeline_read), run the fused Adam kernel on it, write it back (waited for only
when its buffer is needed again with pipeline_write)."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable

import torch

from engine.offload.nvme_setup import NvmeSettings
from engine.offload.sub_groups import Job, grad_buffer
from engine.offload.swap_file import SwapHandle
from engine.ops.adam import AdamTensors, adam_step
from engine.ops.aio import AioContext, IOHandle


class SwappedRun:
    """The step over `jobs`. `begin(target, drain)` returns where a gather wants the target's updated
    values (None: nowhere), once the target may begin; it calls `drain()` first when it would wait, since
    the gathers that would ask may wait for the targets written so far. `written(target)` is called once a
    target's parts are all written back. `run()` returns with no transfer in flight, raised or not (the
    buffers are reused)."""

    def __init__(
        self,
        jobs: list[Job],
        buffers: list[dict[str, torch.Tensor]],
        context: AioContext,
        settings: NvmeSettings,
        begin: Callable[[int, Callable[[], None]], torch.Tensor | None],
        written: Callable[[int], None],
    ) -> None:
        self._jobs = jobs
        self._buffers = buffers
        self._context = context
        self._settings = settings
        self._begin = begin
        self._written = written
        self._left = Counter(id(job.swapped.master) for job in jobs)
        """Target -> its parts not yet written back."""
        self._fill: dict[int, torch.Tensor | None] = {}
        """Target -> where its updated values go (a gather's buffer), while the step is on that target."""
        self._free = list(range(len(buffers)))
        self._writing: deque[tuple[int, list[SwapHandle], int]] = deque()
        """(buffer, its writes, target), oldest first."""
        self._reading: dict[int, tuple[int, list[SwapHandle | IOHandle]]] = {}
        """Job index -> (buffer, its reads)."""

    def run(self) -> None:
        try:
            for k in range(len(self._jobs)):
                self._step_part(k)
            self._drain()
        finally:  # after a failure: nothing may still move data into or out of the buffers
            handles = [h for _, hs in self._reading.values() for h in hs] + [
                h for _, hs, _ in self._writing for h in hs
            ]
            for h in handles:
                with contextlib.suppress(Exception):
                    h.wait()

    def _step_part(self, k: int) -> None:
        """Job k: its values read, updated, handed to a gather that waits for them, written back."""
        s, part, scalars = self._jobs[k]
        out = self._destination(id(s.master))
        if k not in self._reading:
            self._start_read(k)
        ahead = k + 1 < len(self._jobs) and k + 1 not in self._reading
        if self._settings.pipeline_read and ahead and (self._free or self._writing):
            self._start_read(k + 1)
        b, handles = self._reading.pop(k)
        for h in handles:
            h.wait()
        buf, n = self._buffers[b], part.grad.numel()
        master = buf["master"][:n] if part.master is None else part.master
        grad = grad_buffer(buf, part) if s.grad_file is not None else part.grad
        lp = [part.lp] if part.lp is not None else None
        adam_step(AdamTensors([master], [grad], [buf["exp_avg"][:n]], [buf["exp_avg_sq"][:n]], lp), scalars)
        if out is not None:  # a gather waits for these values: from here, not from the file
            out[part.offset : part.offset + n].copy_(master)
        if s.grad_file is not None:  # read for the last time: zeros on disk, out of memory (not read back)
            s.grad_file.discard(part.grad)
        writes = [f.write(buf[name][:n], part.offset) for name, f in s.files.items()]
        self._writing.append((b, writes, id(s.master)))
        if not self._settings.pipeline_write:
            self._wrote(*self._writing.pop())
        while self._writing and all(h.done() for h in self._writing[0][1]):  # waiters told as soon as it is on disk
            self._wrote(*self._writing.popleft())

    def _wrote(self, b: int, handles: list[SwapHandle], target: int) -> None:
        for h in handles:
            h.wait()
        self._free.append(b)
        self._left[target] -= 1
        if not self._left[target]:
            self._fill.pop(target, None)  # the gather holds it now: memory of one unit, not of every unit stepped
            self._written(target)

    def _drain(self) -> None:
        """Wait for every write in flight and tell the waiters of each target written."""
        while self._writing:
            self._wrote(*self._writing.popleft())

    def _take_buffer(self) -> int:
        if not self._free:
            self._wrote(*self._writing.popleft())
        return self._free.pop()

    def _start_read(self, k: int) -> None:
        s, part = self._jobs[k].swapped, self._jobs[k].part
        b = self._take_buffer()
        buf = self._buffers[b]
        n = part.grad.numel()
        reads: list[SwapHandle | IOHandle] = [f.read(buf[name][:n], part.offset) for name, f in s.files.items()]
        if s.grad_file is not None:  # with O_DIRECT, past the page cache ([Note: gradients past the page cache])
            reads.append(self._context.read(s.grad_file.file, grad_buffer(buf, part), s.grad_file.offset(part.grad)))
        self._reading[k] = (b, reads)

    def _destination(self, target: int) -> torch.Tensor | None:
        if target not in self._fill:
            self._fill[target] = self._begin(target, self._drain)
        return self._fill[target]
