"""`deepspeed.checkpointing` IS engine.checkpointing (the same module object): configure() sets state that
checkpoint() reads, so an alias holding copies of its names would configure one module and checkpoint
with another. Megatron-DeepSpeed calls deepspeed.checkpointing.configure / checkpoint /
get_cuda_rng_tracker / model_parallel_cuda_manual_seed."""

import sys

import engine.activation_checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
