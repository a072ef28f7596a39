"""Optimizers and LR schedules built from the `optimizer` / `scheduler` config sections."""

from engine.optim.adam import ReferenceAdam
from engine.optim.lamb import Lamb
from engine.optim.lion import Lion
from engine.optim.one_cycle import OneCycle
from engine.optim.optimizers import build_optimizer
from engine.optim.schedule_factory import Scheduler, build_scheduler
from engine.optim.schedules import BatchSchedule, LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "BatchSchedule",
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "ReferenceAdam",
    "Scheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
