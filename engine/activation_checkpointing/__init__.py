"""Activation checkpointing, public as engine.checkpointing (DeepSpeed's deepspeed.checkpointing), with
ZeRO-R's activation options (paper section 6): partitioned checkpoints over the tensor-parallel group (P_a), in host memory (P_a+cpu) and
in one contiguous arena (M_D).

    engine.checkpointing.configure(engine.parallel, deepspeed_config="ds.json")   # or the config section
    h = engine.checkpointing.checkpoint(block, h)                                 # in the model's forward

engine.initialize configures it from the config's `activation_checkpointing` section over the
engine's tensor-parallel group, unless configure() was called first. Megatron-DeepSpeed calls
configure, checkpoint, get_cuda_rng_tracker and model_parallel_cuda_manual_seed by these names.
"""

from __future__ import annotations

from engine.activation_checkpointing import contiguous, ledger
from engine.activation_checkpointing.function import checkpoint, non_reentrant_checkpoint
from engine.activation_checkpointing.settings import (
    check_engine_options,
    check_options,
    configure,
    configure_from_engine,
    current,
    is_configured,
    reset,
    unconfigure,
)
from engine.parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

stats = ledger.stats
"""Checkpoints and bytes kept now and at peak (engine/activation_checkpointing/ledger.py LedgerStats)."""
reset_peak = ledger.reset_peak
arena_stats = contiguous.stats
after_forward = contiguous.check
"""The engine calls it after the model's forward: the named error if number_checkpoints was too small."""


__all__ = [
    "after_forward",
    "arena_stats",
    "check_engine_options",
    "check_options",
    "checkpoint",
    "configure",
    "configure_from_engine",
    "current",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "reset_peak",
    "stats",
    "unconfigure",
]
