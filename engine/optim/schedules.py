"""DeepSpeed's per-batch LR schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest.

OneCycle lives in one_cycle.py. All share `BatchSchedule`, DeepSpeed's interface:
constructed with (optimizer, **params), `step(last_batch_iteration=None)` once per optimizer
step (never on skipped fp16 steps), `get_lr()`, `get_last_lr()`, and a state_dict of just
{"last_batch_iteration": n}.

[Note: iteration counting, as in DeepSpeed]
`last_batch_iteration` starts at -1. Construction writes the lr for iteration -1 into the
optimizer (WarmupLR: warmup_min_lr; WarmupCosineLR: 0; LRRangeTest/OneCycle: their min lr), so
the first optimizer step runs with it; the following `step()` moves to iteration 0, which for
the warmups is again the start value (log(1) = 0, 0 / N = 0).

Two deliberate differences from DeepSpeed, both only visible when resuming:
- `load_state_dict()` (and construction with last_batch_iteration != -1) also writes that
  iteration's lr into the optimizer; DeepSpeed waits for the next `step()`. The value written is
  the one DeepSpeed's restored optimizer state holds, so training is identical either way.
- WarmupCosineLR keeps its base lrs in each group's "initial_lr" (as torch schedulers do), so a
  schedule rebuilt after its own construction zeroed the lr still knows the configured lr.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from engine.config.errors import ConfigError
from engine.optim._check import check_bool, check_number, check_positive_int

logger = logging.getLogger(__name__)

_SECTION = "scheduler.params"
WARMUP_TYPES = ("log", "linear")


def set_group_lrs(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[float]:
    """Write one lr per group; a tensor lr (capturable/fused optimizers) is updated in place."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


def per_group(key: str, value: Any, num_groups: int) -> list[float]:
    """DeepSpeed allows a number (same for every group) or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ConfigError(
                f"{_SECTION}.{key} has {len(value)} values but the optimizer has {num_groups} param "
                "groups; give one value per group or a single number."
            )
        return [check_number(f"{_SECTION}.{key}", v) for v in value]
    return [check_number(f"{_SECTION}.{key}", value)] * num_groups


def warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at `iteration`: log(it+1)/log(N) or it/N, 1.0 from N on."""
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> tuple[int, str]:
    steps = check_positive_int(f"{_SECTION}.warmup_num_steps", warmup_num_steps)
    if warmup_type not in WARMUP_TYPES:
        # DeepSpeed takes an unknown type as "log" (with a warning), so a config it trains with trains
        # the same here; said by name, since a typo ("Linear") changes the curve.
        logger.warning(
            '%s.warmup_type %r is neither "log" nor "linear": the warmup is "log", as in DeepSpeed',
            _SECTION,
            warmup_type,
        )
        warmup_type = "log"
    # DeepSpeed uses at least 2 warmup steps so that log(N) is never 0.
    return max(2, steps), warmup_type


class BatchSchedule:
    """Base: holds the iteration counter and writes `get_lr()` into the optimizer on each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise ConfigError(f"{_SECTION}.last_batch_iteration must be an integer, got {last_batch_iteration!r}.")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        """The lr of every param group at `self.last_batch_iteration`."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr() called before any lr was set")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "last_batch_iteration" not in state_dict:
            raise KeyError(f"{type(self).__name__} state_dict needs 'last_batch_iteration', got {sorted(state_dict)}")
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()  # See [Note: iteration counting, as in DeepSpeed]

    def _apply(self) -> None:
        self._last_lr = set_group_lrs(self.optimizer.param_groups, self.get_lr())


class WarmupLR(BatchSchedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps (log or linear), then constant. Without
    warmup_max_lr each group warms up to its own lr, the optimizer's (DeepSpeed's default)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        self.min_lrs = per_group("warmup_min_lr", warmup_min_lr, n)
        if warmup_max_lr is None:  # read before this schedule writes warmup_min_lr into the groups
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.max_lrs = per_group("warmup_max_lr", warmup_max_lr, n)
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        self._apply()

    def _gamma(self) -> float:
        return warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to 0 at total_num_steps (and 0 after)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = check_positive_int(f"{_SECTION}.total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(BatchSchedule):
    """Ratios of each group's configured lr: warmup_min_ratio -> 1 over warmup_num_steps, then a
    cosine from 1 down to cos_min_ratio at total_num_steps, held there afterwards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = check_positive_int(f"{_SECTION}.total_num_steps", total_num_steps)
        # DeepSpeed documents warmup_min_ratio as "float or list" but only handles a float.
        self.warmup_min_ratio = check_number(f"{_SECTION}.warmup_min_ratio", warmup_min_ratio, minimum=0.0)
        self.cos_min_ratio = check_number(f"{_SECTION}.cos_min_ratio", cos_min_ratio, minimum=0.0)
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)
        # See [Note: iteration counting, as in DeepSpeed] for why "initial_lr".
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", float(group["lr"]))
        self.org_lrs = [float(group["initial_lr"]) for group in optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        # Progress is clamped to 1 so the lr stays at the floor past total_num_steps instead of
        # rising again along the cosine (DeepSpeed's current behaviour).
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(BatchSchedule):
    """lr = min_lr * (1 + step_rate * interval), interval = (it + 1) / step_size (floored when
    staircase): a steadily growing lr for finding the largest stable one."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group("lr_range_test_min_lr", lr_range_test_min_lr, len(optimizer.param_groups))
        self.step_size = check_positive_int(f"{_SECTION}.lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = check_number(f"{_SECTION}.lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = check_bool(f"{_SECTION}.lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]
