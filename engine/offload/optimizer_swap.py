"""Optimizer state on NVMe (ZeRO-Infinity's `offload_optimizer.device: "nvme"`): the Adam moments of
every master, and the fp32 master itself where it is a copy of a low-precision parameter, live only
in swap files (engine/offload/); the fused Adam step streams them through a few host buffers.

# [Note: the swapped step]
Each master (a MasterTarget) is cut into sub-groups of at most `sub_group_size` elements, at file
offsets that are multiples of a 4 KiB-aligned size (`sub_group_cuts`), so that their reads and writes
take O_DIRECT (engine/ops/aio.py: a request goes there only when its offset and size are multiples
of 4096 bytes). Cut at sub_group_size itself, a size like 20M (80,000,000 bytes) put three sub-groups
in four off the 4 KiB grid and sent them through the page cache: 0% of a step's writes and 32% of
its reads went direct at sub_group_size 100000, against 90-92% at 102400. A sub-group
is read into a free buffer (its exp_avg, exp_avg_sq, and master when swapped), updated by the fused
Adam kernel (engine/ops/adam.py, the same call the in-memory offload makes, so the numbers are
bitwise the same), and written back. With `pipeline_read` the next sub-group's read is started
before this one is computed; with `pipeline_write` a write is waited for only when its buffer is
needed again. `buffer_count` buffers bound the memory: buffer_count x sub_group_size x 3 x 4 bytes
(x 4 x 4 at stage 3, whose gradients are read into them too: [Note: gradients past the page cache]).

Between steps nothing of the swapped state is in memory: a swapped master's `.data` is empty and
optimizer.state[master] holds only "step". `resident()` brings it all back for a checkpoint save or
load (the memory of the in-memory run, for the save's duration) and writes it back after.

# [Note: the step behind the next forward]
With parameters on NVMe too (stage 3), every reader of the swapped state comes through this class: a
gather reads its unit's masters with start_read_master, a checkpoint's save or load with resident(),
the next step with step(). So step() does not wait for the swapped step to end. It plans it in the
caller's thread, with everything decided before any update as in the in-line step: the coefficient
the global norm, the overflow vote and clipping gave, each target's step count, the learning rate and
other scalars of this step. Then a thread runs it, targets in the order the next forward reads them
(`order`, the stage's recorded trace). Each reader waits for what it reads: a gather for its master's
target (all its parts written back), everything else for the whole step (the next step, a
checkpoint, destroy, and the next backward, whose reductions overwrite the gradients the step reads).
The forward computes while the step's transfers go on: at 3.65B parameters, 45 GB a rank and 38 s
with nothing else running, against a forward of 23 s that read 8 GB. The step begins a target only
once a gather has asked for it or for a later one, or once a reader waits for the whole step
(`_may_begin`), so every gather is handed its values. Run ahead, the step wrote targets back before
their gathers asked, and they read them from disk again: at 3.65B one rank read 6 GB a step more than
the other, its step being faster than the forward, which goes at the slower rank's pace. The
arithmetic is the in-line step's (the same kernel on the same values), so the results are bitwise the
same. An error in the thread is raised again in the first thread that waits.

Every rank creates its swap folder (engine/offload/swap_dir.py); a failure on any rank is raised on
every rank, so none waits in a collective for a rank that stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from engine.offload.mapped_file import MappedFile
from engine.offload.nvme_setup import NvmeSettings, agreed, open_swap_dir
from engine.offload.staged_writes import StagedWriter
from engine.offload.step_thread import StepThread
from engine.offload.sub_groups import MOMENTS, Job, Swapped, SwapTarget, swapped_target
from engine.offload.swap_dir import SwapDir
from engine.offload.swap_file import SwapHandle
from engine.offload.swapped_run import SwappedRun
from engine.ops.adam import AdamScalars
from engine.ops.aio import AioContext, aligned_empty


class _AfterStep:
    """A swapped master's values for a gather while the step runs behind the forward: filled by the step
    itself (`filled`: registered before the step began the target), or read from the file once the step
    has written it back (a read ahead of the gather must not wait for the step when it is made)."""

    def __init__(self, swap: OptimizerSwap, s: Swapped, out: torch.Tensor, filled: bool) -> None:
        self._swap, self._s, self._out, self._filled = swap, s, out, filled

    def wait(self) -> int:
        self._swap.wait_for(self._s.master)
        if self._filled:
            return self._out.numel() * self._out.element_size()
        return self._s.files["master"].read(self._out).wait()


class OptimizerSwap:
    """The swapped state of MasterStep's targets and the step over it (see [Note: the swapped step])."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        targets: Sequence[SwapTarget],
        settings: NvmeSettings,
        swap_dir: SwapDir | None = None,
    ) -> None:
        """`swap_dir`: the folder already opened (stage 3 maps the gradients into it first), else a new one."""
        self.settings = settings
        self.dir: SwapDir = swap_dir if swap_dir is not None else open_swap_dir(settings)
        self.context = AioContext(settings.aio)
        self._grad_writes = StagedWriter(self.context) if settings.grads else None
        """Stage 3's reductions write the mapped gradients through it ([Note: gradients past the page cache])."""
        self.by_master: dict[int, Swapped] = {}
        self._mapped_grads: dict[int, MappedFile] = {}
        """id(gradient) -> the mapped swap file that holds it (settings.grads)."""
        self.background = settings.params and all(t.lp is None for t in targets)
        """Steps run behind the next forward (see [Note: the step behind the next forward]): every master
        is on disk and read only through this class."""
        self.order: list[torch.Tensor] = []
        """The masters in the order the next forward reads them (the stage's recorded trace); the others after."""
        self._running: StepThread | None = None
        """The step running behind the forward, until a reader has waited for all of it (finish)."""
        self.steps_behind = 0
        """Steps run behind the forward, over the swap's life."""
        self.handed = 0
        """Gathers given their updated values by the step running behind the forward (no read from disk)."""
        self.reread = 0
        """Gathers that came after the running step had begun their target, and so read it back from disk."""
        self._lock = threading.Lock()
        self.held = threading.Event()
        """Set when a running step first waits for a gather to ask for a target: a test's sign that the step
        got as far as it may on its own (see `_may_begin`)."""
        self._asked = threading.Condition(self._lock)
        """Notified when a reader asks for a target or lets the step run on (see `_may_begin`)."""
        self._position: dict[int, int] = {}
        """id(master) -> its target's place in the running step's order."""
        self._asked_upto = -1
        """The furthest place in that order a gather has asked for (under _lock)."""
        self._run_on = True
        """The running step begins its targets without waiting for gathers to ask (under _lock)."""
        self._begun: set[int] = set()
        """id(master) of the targets the running step has begun (under _lock)."""
        self._fill: dict[int, torch.Tensor] = {}
        """id(master) -> where a gather wants its updated values, registered before the step began it: the
        step copies each updated sub-group there, and the gather reads nothing from disk (under _lock)."""
        mapped_at = {m.tensor.data_ptr(): m for m in self.dir.mapped_files.values()}

        def build() -> None:
            for i, t in enumerate(targets):
                # A copy of a low-precision parameter is swapped; the parameter's own fp32 storage only when
                # parameters go to NVMe too (stage 3, whose gathers then read it from the file).
                names = [*MOMENTS, *(["master"] if t.lp is not None or settings.params else [])]
                files = {k: self.dir.file(f"{k}.{i}", t.master.numel(), torch.float32, self.context) for k in names}
                grad_file = self._mapped_grad(t.grad, mapped_at) if settings.grads else None
                state = optimizer.state[t.master]
                self.by_master[id(t.master)] = swapped_target(i, t, files, state, grad_file, settings.sub_group_size)
            self._write_out(initial=True)

        try:
            agreed(build, "writing the optimizer state to the NVMe swap files")
        except BaseException:
            self.close()  # a failed start leaves no swap folder behind, so the next one starts clean
            raise
        # Sized to the largest sub-group there is: sub_group_size is a bound (transformers' configs write 1e14).
        largest = max((p.grad.numel() for sw in self.by_master.values() for p in sw.parts), default=0)
        names = (*MOMENTS, "master", *(["grad"] if settings.grads else []))
        self._buffers = [
            {k: aligned_empty(largest, torch.float32) for k in names} for _ in range(settings.buffer_count)
        ]

    def _mapped_grad(self, grad: torch.Tensor, mapped_at: dict[int, MappedFile]) -> MappedFile | None:
        """The swap file `grad` (made by map_gradients) is mapped from (`mapped_at`: the folder's mapped
        files by address); None for an empty gradient."""
        if grad.numel() == 0:
            return None
        mapped = mapped_at.get(grad.data_ptr())
        if mapped is None:
            raise RuntimeError("NVMe settings say the gradients are swapped, but this one is not in a swap file")
        self._mapped_grads[id(grad)] = mapped
        return mapped

    def store_grad(self, grad: torch.Tensor, values: torch.Tensor) -> bool:
        """Start grad.copy_(values) with O_DIRECT, for a mapped gradient ([Note: gradients past the page
        cache]); False, storing nothing, for one that is not mapped. wait_stored_grads() ends them."""
        mapped = self._mapped_grads.get(id(grad))
        if mapped is None or self._grad_writes is None:
            return False
        self._grad_writes.write(mapped.file, values, mapped.offset(grad))
        return True

    def wait_stored_grads(self) -> None:
        """Every gradient store_grad started is in its file (raises the first failed write)."""
        if self._grad_writes is not None:
            self._grad_writes.wait_all()

    def release_grad(self, grad: torch.Tensor) -> None:
        """A mapped gradient's pages leave this process's memory (values kept in its file); no-op for
        gradients that are not mapped."""
        mapped = self._mapped_grads.get(id(grad))
        if mapped is not None:
            mapped.release(grad.reshape(-1))

    # --------------------------------------------------------------------------------- the step
    def step(self, groups: list[tuple[dict[str, Any], bool, bool]], coef: float) -> None:
        """One optimizer step of every (param group, adamw_mode, bias_correction) over its swapped state:
        planned now, run now or behind the next forward (see [Note: the step behind the next forward])."""
        self.finish()  # the previous step's, if it is still running: this one reads what it writes
        jobs = [
            job
            for group, adamw_mode, bias_correction in groups
            for job in self._plan(group, coef, adamw_mode, bias_correction)
        ]
        if not self.background:
            self._run(jobs, lambda target: None)
            return
        position = {id(m): k for k, m in enumerate(self.order)}
        jobs.sort(key=lambda job: position.get(id(job.swapped.master), len(position)))  # stable: parts in file order
        self.steps_behind += 1
        self._begun, self._fill = set(), {}
        self.held.clear()
        self._position = {t: k for k, t in enumerate(dict.fromkeys(id(job.swapped.master) for job in jobs))}
        self._asked_upto, self._run_on = -1, False
        self._running = StepThread(lambda written: self._run(jobs, written), [id(job.swapped.master) for job in jobs])

    def _plan(self, group: dict[str, Any], coef: float, adamw_mode: bool, bias_correction: bool) -> list[Job]:
        """The group's sub-groups, each with the scalars of this step (its learning rate now: a scheduler
        may change the group's before the step has run)."""
        jobs: list[Job] = []
        for p in group["params"]:
            s = self.by_master[id(p)]
            s.state["step"] += 1.0
            scalars = AdamScalars.of_group(
                group, int(s.state["step"]), adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=coef
            )
            jobs.extend(Job(s, part, scalars) for part in s.parts)
        return jobs

    def _run(self, jobs: list[Job], written: Callable[[int], None]) -> None:
        """The step over `jobs`, in line or in the step's thread; `written(id(master))` once a target's
        parts are all written back (a test holds the thread back by wrapping this method)."""
        SwappedRun(jobs, self._buffers, self.context, self.settings, self._begin, written).run()

    def _begin(self, target: int, drain: Callable[[], None]) -> torch.Tensor | None:
        """The running step's wait before it begins `target` (see `_may_begin`); where a gather wants the
        target's updated values, or None."""
        with self._lock:
            ready = self._may_begin(target)
        if not ready:  # the gathers that would ask may be waiting for the targets written so far
            drain()
            self.held.set()
        with self._lock:
            self._asked.wait_for(lambda: self._may_begin(target))
            self._begun.add(target)
            return self._fill.pop(target, None)

    def _may_begin(self, target: int) -> bool:
        """Whether the running step may begin `target` (under _lock): once a gather has asked for it or for a
        later one, or once a reader waits for the whole step (see [Note: the step behind the next forward])."""
        return self._run_on or self._asked_upto >= self._position.get(target, 0)

    def _let_run_on(self) -> None:
        with self._lock:
            self._run_on = True
            self._asked.notify_all()

    def finish(self) -> None:
        """Wait for the step running behind the forward, if any; raise its error (once) if it failed."""
        running, self._running = self._running, None
        if running is not None:
            self._let_run_on()
            error = running.join()
            if error is not None:
                raise error

    def wait_for(self, master: torch.Tensor) -> None:
        """Wait until the running step, if any, has written `master`'s target back; if it failed, raise its
        error (once: the step is over then, as an in-line step that raised would be)."""
        if self._running is not None:
            self._running.wait_for(id(master))
            if self._running.error is not None:
                self.finish()

    def start_read_master(self, master: torch.Tensor) -> tuple[torch.Tensor, SwapHandle | _AfterStep | None]:
        """A swapped master's values, with the read from its file that fills them started now (wait on
        the handle before using them); the tensor itself and None when it is in memory (not swapped,
        or resident for a checkpoint)."""
        s = self.by_master.get(id(master))
        if s is None or "master" not in s.files or master.numel() == s.shape.numel():
            return master, None
        flat = aligned_empty(s.shape.numel(), torch.float32)  # aligned: the read can take O_DIRECT
        running = self._running
        if running is not None and not running.finished(id(master)):
            with self._lock:  # the step thread takes a target's destination when it begins the target
                filled = id(master) not in self._begun and id(master) not in self._fill
                if filled:
                    self._fill[id(master)] = flat
                self.handed += filled
                self.reread += not filled
                self._asked_upto = max(self._asked_upto, self._position.get(id(master), -1))
                self._asked.notify_all()
            return flat.view(s.shape), _AfterStep(self, s, flat, filled)
        return flat.view(s.shape), s.files["master"].read(flat)

    # ------------------------------------------------------------------------- resident state
    @contextmanager
    def resident(self) -> Iterator[None]:
        """Every swapped tensor in memory (masters' .data and the moments in optimizer.state) for the
        duration, written back and dropped after (a load's new values included)."""
        self.finish()
        for s in self.by_master.values():
            if "master" in s.files:
                s.master.data = torch.empty(s.shape, dtype=torch.float32)
                s.files["master"].read(s.master.data.view(-1)).wait()
            for name in MOMENTS:
                s.state[name] = torch.empty(s.shape, dtype=torch.float32)
                s.files[name].read(s.state[name].view(-1)).wait()
        try:
            yield
        finally:
            self._write_out(initial=False)

    def _write_out(self, initial: bool) -> None:
        """Write every swapped tensor to its file and drop it from memory (initial: zero moments, or the
        optimizer's own state if it already has some)."""
        for s in self.by_master.values():
            values = {name: s.state.get(name) for name in MOMENTS}
            for name in MOMENTS:
                value = values[name]
                if not (torch.is_tensor(value) and value.numel() == s.master.numel()):
                    value = torch.zeros(s.master.numel(), dtype=torch.float32)
                s.files[name].write(value.detach().reshape(-1).contiguous()).wait()
                s.state.pop(name, None)
            if "master" in s.files:
                s.files["master"].write(s.master.detach().reshape(-1).contiguous()).wait()
                s.master.data = torch.empty(0, dtype=torch.float32)
        del initial

    def disk_bytes(self) -> int:
        files = sum(f.numel * 4 for s in self.by_master.values() for f in s.files.values())
        return files + sum(m.nbytes for m in self._mapped_grads.values())

    def close(self) -> None:
        """Remove the swap folder (after waiting for a running step: an error of it was raised by finish(),
        which every reader calls first, or is dropped with the state it failed to write)."""
        if self._running is not None:
            self._let_run_on()
            self._running.join()
            self._running = None
        self.context.close()
        self.dir.close()
