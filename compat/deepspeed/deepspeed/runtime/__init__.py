"""`deepspeed.runtime`: Accelerate reads it as an attribute of `deepspeed`, so it is imported there."""

from deepspeed.runtime import engine, lr_schedules, sequence_parallel, zero

__all__ = ["engine", "lr_schedules", "sequence_parallel", "zero"]
