"""The accumulation window: the Engine's one record of where training is between optimizer steps.

A window is the micro-steps (backwards) whose gradients one optimizer step consumes:
gradient_accumulation_steps of them, or what a framework decides with
set_gradient_accumulation_boundary(), or whatever ran before optimizer.step() (Lightning Fabric).

    EMPTY --backward--> ACCUMULATING --step at the boundary--> STEPPING --> EMPTY
      |                                                           |
      +------------------step at the boundary---------------------+   (a window of no backward)
    any state --destroy()--> DESTROYED

The counters DeepSpeed users read (micro_steps, global_steps, global_samples, skipped_steps) live here,
and move with the states: `micro_steps` is restarted at global_steps x gradient_accumulation_steps in
one place (restart). Inside engine.no_sync() the window is `unsynced` (a step is refused there).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch

from engine.zero.state_moves import check_move


class WindowState(enum.Enum):
    """Where the current accumulation window is."""

    EMPTY = "empty"
    """No backward since the last optimizer step (or since the engine was built or a checkpoint loaded)."""
    ACCUMULATING = "accumulating"
    """At least one backward's gradients are in the window."""
    STEPPING = "stepping"
    """The optimizer step of the window is running (clip, update, LR schedule, counters, reports)."""
    DESTROYED = "destroyed"
    """engine.destroy() ran: every call but destroy() is refused."""


_MOVES: dict[WindowState, frozenset[WindowState]] = {
    WindowState.EMPTY: frozenset({WindowState.ACCUMULATING, WindowState.STEPPING, WindowState.DESTROYED}),
    WindowState.ACCUMULATING: frozenset({WindowState.ACCUMULATING, WindowState.STEPPING, WindowState.DESTROYED}),
    WindowState.STEPPING: frozenset({WindowState.EMPTY, WindowState.DESTROYED}),
    WindowState.DESTROYED: frozenset(),
}
"""The legal moves. A step that raised is not a move: stepping() rolls the window back to the state it
was in (its backwards' gradients are still there), so the step can be retried."""


class TrainingWindow:
    """The window's state, its loss, the step counters, the no_sync() block and a boundary override."""

    def __init__(self, gradient_accumulation_steps: int) -> None:
        self.state = WindowState.EMPTY
        self._gas = gradient_accumulation_steps
        self.micro_steps = 0
        """engine.step() calls so far (DeepSpeed's micro_steps): the boundary is every gas-th."""
        self.global_steps = 0
        """Optimizer steps taken, skipped ones included (DeepSpeed counts those too)."""
        self.global_samples = 0
        self.skipped_steps = 0
        self.backwards = 0
        """Backwards in this window."""
        self.loss: torch.Tensor | float = 0.0
        """Sum of the window's unscaled micro-batch losses: kept a tensor, as converting it would synchronise
        a GPU on every micro-step."""
        self.last_loss: float | None = None
        """Mean unscaled loss of the last window that was stepped (engine.get_loss())."""
        self.last_step_applied = False
        """The last engine.step() took an optimizer step that updated the weights (was_step_applied())."""
        self.boundary_override: bool | None = None
        """set_gradient_accumulation_boundary() for the current micro-step (frameworks that manage
        accumulation); None: every gas-th micro-step is the boundary."""
        self.unsynced = False
        """Inside engine.no_sync(): backwards do not reduce, and a step is refused."""

    # ------------------------------------------------------------------------------- moves
    def _move(self, to: WindowState) -> None:
        check_move("the training window", self.state, to, _MOVES)
        self.state = to

    def add_backward(self, loss: torch.Tensor) -> None:
        """A backward ran: its unscaled loss joins the window."""
        self._move(WindowState.ACCUMULATING)
        self.loss = self.loss + loss
        self.backwards += 1

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The window's optimizer step: STEPPING for its duration, then a new EMPTY window; if the step
        raised, the window as it was."""
        before = self.state
        self._move(WindowState.STEPPING)
        try:
            yield
        except BaseException:
            if self.state is WindowState.STEPPING:  # not dropped (see drop): rolled back, as it was
                self.state = before
            raise
        self.last_loss = float(self.loss) / max(self.backwards, 1)
        self._clear()
        self._move(WindowState.EMPTY)

    def drop(self) -> None:
        """The step's gradients were dropped (a non-finite step that stops training): a new window, at the
        micro-step of the last optimizer step, so the step can be rerun."""
        self._clear()
        self.restart()
        self._move(WindowState.EMPTY)

    def destroy(self) -> None:
        self._move(WindowState.DESTROYED)

    @property
    def is_empty(self) -> bool:
        """No backward's gradients wait for a step."""
        return self.state is WindowState.EMPTY

    @property
    def destroyed(self) -> bool:
        return self.state is WindowState.DESTROYED

    def _clear(self) -> None:
        self.loss, self.backwards = 0.0, 0

    # ---------------------------------------------------------------------------- counters
    def restart(self) -> None:
        """micro_steps at the start of the window after global_steps steps, and no boundary override: after
        an optimizer.step() mid-window, a non-finite step, or a checkpoint's load."""
        self.micro_steps = self.global_steps * self._gas
        self.boundary_override = None

    def end_micro_step(self) -> None:
        """engine.step() returned: the next micro-step, without the override of this one."""
        self.micro_steps += 1
        self.boundary_override = None

    def is_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self._gas == 0

    def first_micro_step(self) -> bool:
        """The current micro-step is the first of its window by the count (the flops profiler's cue)."""
        return self.micro_steps % self._gas == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.unsynced = self.unsynced, True
        try:
            yield
        finally:
            self.unsynced = previous
