"""Stage 3's prefetch plan: the recorded order of unit uses and the decisions taken from it.

Pure bookkeeping over unit indices and sizes (elements): no tensors, no collectives, no autograd.
Stage 3 (engine/zero/stage3/gather.py) tells it each use of a unit and asks it what to prefetch and
whether to keep a unit gathered after its forward; it runs the all-gathers itself.

# [Note: prefetch]
# Every use of a unit in a micro-step (forward and backward) is recorded. From the next micro-step
# on, each use that matches the recorded order starts the all-gathers of the following units
# asynchronously, up to stage3_prefetch_bucket_size elements ahead and within
# stage3_max_live_parameters gathered (or gathering) at once, so communication overlaps compute; as
# in DeepSpeed, the unit that crosses either limit is started too (see to_prefetch).
# A unit whose next recorded use comes within stage3_max_reuse_distance elements of other units'
# uses (the last block always: its backward comes next) stays gathered after its forward, as in
# DeepSpeed; with DeepSpeed's default (1e9) a model under a billion parameters is gathered once per
# step, and 0 re-gathers every block for its backward (FSDP's reshard_after_forward). Units under
# stage3_param_persistence_threshold elements stay gathered until their gradients are reduced.
# The trace records every *use* of a unit (a kept unit's reuse too), so it is the same each step
# either way. When the order stops matching (dynamic control flow), the rest of the micro-step
# gathers on demand and the new order is recorded (debug log); every rank follows its own
# identical trace, so collectives stay in the same order on all ranks.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Iterator, Sequence


class TraceMatch(enum.Enum):
    """What a recorded use of a unit means for prefetching."""

    FOLLOWED = "followed"
    """The use is the next one in the recorded order: prefetch the units after it."""
    DIVERGED = "diverged"
    """The first use of this micro-step off the recorded order: the rest of it gathers on demand."""
    UNTRACKED = "untracked"
    """Nothing to follow: no order recorded yet, the order already diverged in this micro-step, or the
    use is outside training (grad disabled and not in backward)."""


class PrefetchPlan:
    """The unit order of the last micro-step and where this micro-step is in it. See [Note: prefetch]."""

    def __init__(
        self,
        numels: Sequence[int],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int,
        persist_below: int,
    ) -> None:
        self.numels: tuple[int, ...] = tuple(numels)
        """Elements of each unit's gathered buffers (padded), by unit index."""
        self.prefetch_numel = prefetch_numel
        """stage3_prefetch_bucket_size: elements of the units prefetched after one use."""
        self.max_live_numel = max_live_numel
        """stage3_max_live_parameters: elements gathered or gathering beyond which nothing is prefetched or kept."""
        self.max_reuse_numel = max_reuse_numel
        """stage3_max_reuse_distance: elements of other units' uses within which a unit is kept after forward."""
        self.persist_below = persist_below
        """stage3_param_persistence_threshold: units smaller than this stay gathered after their forward."""
        self.trace: list[int] | None = None
        """The unit uses of the last micro-step that recorded any, in order; None before the first."""
        self.recording: list[int] = []
        """The unit uses of this micro-step so far."""
        self.pos = 0
        """How many uses of `trace` this micro-step has matched."""
        self.following = True
        """False once this micro-step left the recorded order."""
        self.order_changes = 0
        """Micro-steps that left the recorded order (dynamic control flow)."""

    @property
    def recording_started(self) -> bool:
        """Whether this micro-step used any unit yet."""
        return bool(self.recording)

    def record(self, index: int, *, in_training: bool) -> TraceMatch:
        """Unit `index` is used (gathered, or found still gathered); `in_training`: grad enabled or in
        backward (an evaluation forward records its uses but follows nothing)."""
        self.recording.append(index)
        if self.trace is None or not self.following or not in_training:
            return TraceMatch.UNTRACKED
        if self.pos < len(self.trace) and self.trace[self.pos] == index:
            self.pos += 1
            return TraceMatch.FOLLOWED
        self.following = False
        self.order_changes += 1
        return TraceMatch.DIVERGED

    def to_prefetch(self, live: Collection[int]) -> list[int]:
        """Units to start gathering now, in order: the next ones in the recorded order that are not
        `live` (gathered or gathering), taken while the elements taken so far are under the limit,
        min(stage3_prefetch_bucket_size, stage3_max_live_parameters - the live units' elements). The
        unit that crosses the limit is taken too, then nothing after it: DeepSpeed's rule
        (PartitionedParameterCoordinator.fetch_sub_module), so a unit larger than the bucket is still
        prefetched alone rather than never (a GPT block of d_model 2048 is 50M elements, DeepSpeed's
        default bucket), and the live total stays under the limit plus one unit."""
        if self.trace is None:
            return []
        limit = min(self.prefetch_numel, self.max_live_numel - self.live_numel(live))
        taken = 0
        chosen: list[int] = []
        for index in self._ahead(live):
            if taken >= limit:
                break
            chosen.append(index)
            taken += self.numels[index]
        return chosen

    def upcoming(self, skip: Collection[int], count: int) -> list[int]:
        """The next `count` distinct units in the recorded order after this position, leaving out `skip`
        (the live ones); none when no order is followed."""
        return list(itertools.islice(self._ahead(skip), count)) if self.following else []

    def _ahead(self, skip: Collection[int]) -> Iterator[int]:
        """The units of the recorded order after this position, each once, leaving out `skip`."""
        seen = set(skip)
        for index in self.trace[self.pos :] if self.trace else ():
            if index not in seen:
                seen.add(index)
                yield index

    def persistent(self, index: int) -> bool:
        """Small enough to keep gathered until its gradients are reduced (cheaper than gathering it again)."""
        return self.numels[index] < self.persist_below

    def keep_after_forward(self, index: int, live: Collection[int]) -> bool:
        """Whether unit `index` stays gathered after its forward: persistent, or reused soon."""
        return self.persistent(index) or self.reused_soon(index, live)

    def reused_soon(self, index: int, live: Collection[int]) -> bool:
        """Whether the recorded order uses unit `index` again before other units of more than
        stage3_max_reuse_distance elements in all are used (the last block, whose backward comes
        next: always), and keeping it stays within stage3_max_live_parameters (`live`: the units
        gathered or gathering, itself included)."""
        if not (self.trace and self.following):
            return False
        if self.live_numel(live) > self.max_live_numel:
            return False
        between: set[int] = set()  # distinct units used before its next use
        between_numel = 0
        for other in self.trace[self.pos :]:
            if other == index:
                return True
            if other not in between:
                between.add(other)
                between_numel += self.numels[other]
                if between_numel > self.max_reuse_numel:
                    return False
        return False

    def live_numel(self, live: Collection[int]) -> int:
        return sum(self.numels[i] for i in live)

    def new_micro_step(self) -> None:
        """A new forward began before this micro-step's backward (or without one): follow the
        recorded order from its start again, keeping it."""
        self.recording, self.pos, self.following = [], 0, True

    def end_micro_step(self) -> None:
        """After a backward: keep the recorded order, or adopt this micro-step's if it differs; start over."""
        if self.recording and self.trace != self.recording:
            self.trace = list(self.recording)
        self.new_micro_step()

    def forget(self) -> None:
        """Drop the recorded order: nothing is prefetched or kept for reuse until a micro-step records one."""
        self.trace = None
