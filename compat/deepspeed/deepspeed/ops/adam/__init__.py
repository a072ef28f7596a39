"""`deepspeed.ops.adam` -> engine.optim.deepspeed_classes."""

from engine.optim.deepspeed_classes import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
