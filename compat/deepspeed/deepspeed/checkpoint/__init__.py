"""`deepspeed.checkpoint` -> engine.checkpoint."""

from deepspeed.checkpoint import utils

__all__ = ["utils"]
