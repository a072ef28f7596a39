"""`scheduler` config section -> a DeepSpeed schedule or a torch.optim.lr_scheduler instance."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.config.errors import ConfigError
from engine.config.types import SchedulerConfig
from engine.optim._check import check_param_names, check_required, did_you_mean, keyword_params
from engine.optim.one_cycle import OneCycle
from engine.optim.schedules import BatchSchedule, LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR

_SECTION = "scheduler.params"

Scheduler = BatchSchedule | LRScheduler

DEEPSPEED_SCHEDULES: dict[str, type[BatchSchedule]] = {
    cls.__name__.lower(): cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}

VALID_LR_SCHEDULES: list[str] = [cls.__name__ for cls in DEEPSPEED_SCHEDULES.values()]
"""DeepSpeed's schedule class names (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`): Accelerate
tells a DeepSpeed schedule from a torch one by `type(scheduler).__name__ in VALID_LR_SCHEDULES`."""


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> Scheduler:
    """Build the schedule named by `cfg.type` (case-insensitive) over `optimizer`.

    DeepSpeed names take DeepSpeed's params; any torch.optim.lr_scheduler class name gets the
    params passed through, checked against the class signature.
    """
    key = cfg.type.lower()
    params: dict[str, Any] = dict(cfg.params)
    cls: type[Any] | None = DEEPSPEED_SCHEDULES.get(key) or _torch_scheduler_classes().get(key)
    if cls is None:
        known = [c.__name__ for c in DEEPSPEED_SCHEDULES.values()] + sorted(
            c.__name__ for c in _torch_scheduler_classes().values()
        )
        raise ConfigError(
            f'scheduler.type "{cfg.type}" is not a known schedule.{did_you_mean(cfg.type, known)} '
            f"Known (case-insensitive): {', '.join(known)}."
        )

    owner = cls.__name__ if key in DEEPSPEED_SCHEDULES else f"torch.optim.lr_scheduler.{cls.__name__}"
    accepted, required, var_kwargs = keyword_params(cls.__init__, skip=2)  # skip self, optimizer
    if not var_kwargs:
        check_param_names(_SECTION, owner, params, accepted)
    check_required(_SECTION, owner, params, sorted(required))
    try:
        return cls(optimizer, **params)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        # torch validates its own params (e.g. OneCycleLR's total_steps) with ValueError.
        raise ConfigError(f"{_SECTION} rejected by {owner}: {exc}") from exc


def _torch_scheduler_classes() -> dict[str, type[Any]]:
    """Lower-cased name -> every public torch.optim.lr_scheduler schedule class."""
    module = torch.optim.lr_scheduler
    classes: dict[str, type[Any]] = {}
    for attr in dir(module):
        obj = getattr(module, attr)
        if attr.startswith("_") or not isinstance(obj, type) or obj is LRScheduler:
            continue
        if issubclass(obj, LRScheduler) or attr == "ReduceLROnPlateau":
            classes[attr.lower()] = obj
    return classes
