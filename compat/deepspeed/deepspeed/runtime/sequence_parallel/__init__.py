"""`deepspeed.runtime.sequence_parallel` -> engine.sequence (Ulysses/ALST) and engine.parallel's
sequence-parallel groups (`parallel_state_sp`)."""

from deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
