"""DeepSpeed's OneCycle schedule: one triangular lr cycle (momentum cycled inversely), then decay.

Shape, with it = last_batch_iteration and total = first_step_size + second_step_size:
- it < total: x = frac((it + 1) / total). Rising half (x <= first/total): scale = x / ratio;
  falling half: scale = (1 - x) / (1 - ratio). lr = min_lr + (max_lr - min_lr) * scale and
  momentum = max_mom - (max_mom - min_mom) * scale. A stair count > 0 holds the scale flat on
  that many stairs per half (computed from the integer offset, as DeepSpeed now does, so float
  error cannot drop a whole stair at the peak).
- it >= total: d = (it - total + 1) / decay_step_size (continuous, not floored);
  lr = min_lr / (1 + decay_lr_rate * d), momentum = max_mom * (1 + decay_mom_rate * d).
  With decay_step_size 0 (or a 0 rate) the value stays at min_lr / max_mom.
The lrs and momenta are one number for every param group or a list with one per group; a
cycle_second_step_size of 0 makes a cycle that only rises. get_mom() gives each group's (beta1, beta2),
as DeepSpeed's does.

Momentum goes to betas[0] for Adam-like optimizers (beta2 is kept; DeepSpeed overwrites it with
0.99, which silently changes the configured optimizer) or to `momentum` for SGD-like ones; with
neither, momentum cycling is switched off with a warning, as DeepSpeed does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from engine.config.errors import ConfigError
from engine.optim._check import check_bool, check_number, check_positive_int
from engine.optim.schedules import BatchSchedule, per_group

logger = logging.getLogger(__name__)

_SECTION = "scheduler.params"


class OneCycle(BatchSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        # A number for every group, or a list with one per group, as DeepSpeed documents.
        self.min_lrs = _non_negative("cycle_min_lr", per_group("cycle_min_lr", cycle_min_lr, n))
        self.max_lrs = _non_negative("cycle_max_lr", per_group("cycle_max_lr", cycle_max_lr, n))
        self.decay_lr_rate = check_number(f"{_SECTION}.decay_lr_rate", decay_lr_rate)

        self.first_step_size = check_positive_int(f"{_SECTION}.cycle_first_step_size", cycle_first_step_size)
        # 0: a cycle that only rises (DeepSpeed accepts it).
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _check_count("cycle_second_step_size", cycle_second_step_size)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _check_count("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _check_count("cycle_second_stair_count", cycle_second_stair_count)
        )
        self.decay_step_size = _check_count("decay_step_size", decay_step_size)

        self.min_moms = per_group("cycle_min_mom", cycle_min_mom, n)
        self.max_moms = per_group("cycle_max_mom", cycle_max_mom, n)
        self.decay_mom_rate = check_number(f"{_SECTION}.decay_mom_rate", decay_mom_rate)
        self.momentum_key = (
            _momentum_key(optimizer) if check_bool(f"{_SECTION}.cycle_momentum", cycle_momentum) else None
        )
        self.cycle_momentum = self.momentum_key is not None

        if last_batch_iteration == -1:
            # DeepSpeed starts at (cycle_min_lr, cycle_min_mom); the first step() then moves the
            # momentum to cycle_max_mom. Kept so the first optimizer step matches DeepSpeed.
            self._last_lr = list(self.min_lrs)
            for group, lr, mom in zip(optimizer.param_groups, self.min_lrs, self.min_moms):
                group["lr"] = _same_kind(group["lr"], lr)
                self._set_momentum(group, mom)
        else:
            self._apply()

    # -- lr / momentum at self.last_batch_iteration -------------------------------------------

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self._skip_decay(self.decay_lr_rate):
            return list(self.min_lrs)
        return [lo / (1.0 + self.decay_lr_rate * self._decay_interval()) for lo in self.min_lrs]

    def _momenta(self) -> list[float]:
        """Each group's cycled momentum (beta1) at self.last_batch_iteration."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self._skip_decay(self.decay_mom_rate):
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * self._decay_interval()) for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | list[float] | None:
        """Per group, as DeepSpeed: (beta1, beta2) for an Adam-like optimizer (beta2 as configured: see the
        module docstring), the momentum for an SGD-like one; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        momenta = self._momenta()
        if self.momentum_key == "betas":
            return [(m, float(g["betas"][1])) for m, g in zip(momenta, self.optimizer.param_groups)]
        return momenta

    def _scale(self) -> float:
        """Position in the triangle, 0 at min lr and 1 at max lr."""
        in_cycle = (self.last_batch_iteration + 1) % self.total_size  # integer offset in the cycle
        if in_cycle <= self.first_step_size:
            steps_done, half_size, stairs = in_cycle, self.first_step_size, self.first_stair_count
        else:
            steps_done, half_size, stairs = (
                self.total_size - in_cycle,
                self.second_step_size,
                self.second_stair_count,
            )
        if stairs > 0:
            return math.floor(steps_done * stairs / half_size) / stairs
        return steps_done / half_size

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _skip_decay(self, rate: float) -> bool:
        return self.decay_step_size == 0 or math.isclose(rate, 0.0)

    # -- writing into the optimizer ------------------------------------------------------------

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self._momenta()):
                self._set_momentum(group, mom)

    def _set_momentum(self, group: dict[str, Any], momentum: float) -> None:
        if self.momentum_key == "betas":
            group["betas"] = (momentum, group["betas"][1])
        elif self.momentum_key == "momentum":
            group["momentum"] = momentum


def _non_negative(key: str, values: list[float]) -> list[float]:
    for value in values:
        check_number(f"{_SECTION}.{key}", value, minimum=0.0)
    return values


def _check_count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{_SECTION}.{key} must be an integer >= 0, got {value!r}.")
    return value


def _momentum_key(optimizer: torch.optim.Optimizer) -> str | None:
    if "betas" in optimizer.defaults:
        return "betas"
    if "momentum" in optimizer.defaults:
        return "momentum"
    logger.warning(
        "OneCycle: cycle_momentum is disabled because %s has neither betas nor momentum",
        type(optimizer).__name__,
    )
    return None


def _same_kind(current: Any, lr: float) -> Any:
    if isinstance(current, torch.Tensor):
        return current.fill_(lr)
    return lr
