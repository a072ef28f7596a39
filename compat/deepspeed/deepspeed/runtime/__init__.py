"""`deepspeed.runtime`: Accelerate reads it as an attribute of `deepspeed`, so it is imported there."""

from deepspeed.runtime import activation_checkpointing, engine, lr_schedules, sequence_parallel, zero

__all__ = ["activation_checkpointing", "engine", "lr_schedules", "sequence_parallel", "zero"]
