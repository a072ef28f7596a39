"""Launching reductions strictly in one order: the rule every stage's gradient communication follows.

# [Note: launch order]
# Collectives must be issued in the same order on every rank, or gloo/NCCL pair the wrong messages
# and hang. Gradients can arrive in a different order on different ranks (a parameter unused on one
# rank, a branch taken on another), so each stage fixes one order of its reductions up front (flat
# stages: buckets by the arrival position of their last parameter; stage 3: units in reverse forward
# order), and a reduction whose gradients are complete waits until every one before it has been
# launched. At the end of backward the rest are launched in order, complete or not (what is missing
# on this rank contributes zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class LaunchInOrder(Generic[T]):
    """Launches `items` in their order: an item only once every item before it was launched."""

    def __init__(self, items: Sequence[T], *, complete: Callable[[T], bool], launch: Callable[[T], None]) -> None:
        self.items = items
        self._complete = complete
        self._launch = launch
        self.next = 0
        """Index of the next item to launch."""

    def launch_ready(self) -> int:
        """Launch the complete items at the head of the order; returns how many were launched."""
        before = self.next
        while self.next < len(self.items) and self._complete(self.items[self.next]):
            self._launch_next()
        return self.next - before

    def launch_rest(self) -> None:
        """Launch every item not launched yet, in order, complete or not."""
        while self.next < len(self.items):
            self._launch_next()

    def launched(self, index: int) -> bool:
        return index < self.next

    @property
    def started(self) -> bool:
        return self.next > 0

    def restart(self) -> None:
        """A new round: nothing launched."""
        self.next = 0

    def _launch_next(self) -> None:
        item = self.items[self.next]
        self.next += 1  # before launching: a launch that fails is not retried out of order
        self._launch(item)
