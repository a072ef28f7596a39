"""`deepspeed.sequence` -> engine.sequence (`layer.DistributedAttention`)."""

from deepspeed.sequence import layer

__all__ = ["layer"]
