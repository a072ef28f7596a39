"""`deepspeed.ops` -> the engine's optimizers under DeepSpeed's class names."""

from deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
