"""`deepspeed.runtime.lr_schedules` -> engine.optim."""

from engine.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from engine.optim.schedule_factory import VALID_LR_SCHEDULES

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
