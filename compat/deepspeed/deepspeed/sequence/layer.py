"""`deepspeed.sequence.layer` -> engine.sequence.attention (Megatron-DeepSpeed's DistributedAttention)."""

from engine.sequence.attention import DistributedAttention

__all__ = ["DistributedAttention"]
