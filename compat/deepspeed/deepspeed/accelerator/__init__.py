"""`deepspeed.accelerator` -> engine.accelerator (CPU and CUDA; DS_ACCELERATOR chooses)."""

from engine.accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
