"""`deepspeed.ops.lion` -> engine.optim.deepspeed_classes."""

from engine.optim.deepspeed_classes import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
