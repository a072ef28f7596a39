"""`deepspeed.runtime.sequence_parallel`: refused by name when used (engine.unsupported)."""

from deepspeed.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
