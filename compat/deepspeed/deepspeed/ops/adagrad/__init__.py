"""`deepspeed.ops.adagrad` -> engine.optim.deepspeed_classes."""

from engine.optim.deepspeed_classes import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
