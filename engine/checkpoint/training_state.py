"""What a checkpoint saves and restores, handed to the store by the Engine (engine/checkpoint/store.py).

The store never sees the Engine: `save` gets a `TrainingState` and `load` fills the objects it names
and returns the saved `Counters` in a `LoadResult`, for the Engine to set on itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.parallel.groups import ParallelGroups
from engine.zero.base import ZeroStage


class Stateful(Protocol):
    """An LR scheduler or a loss scaler: saved and restored through its state dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


@dataclass(frozen=True)
class Counters:
    """The Engine's progress counters, saved by rank 0 and restored on every rank."""

    global_steps: int
    """Optimizer steps taken (skipped fp16 steps included); the default tag is global_step<N>."""
    global_samples: int
    """Samples consumed: global_steps * train_batch_size."""
    skipped_steps: int
    """Steps skipped because fp16 overflowed."""
    micro_steps: int
    """engine.step() calls (micro-batches), which place the next accumulation boundary."""


@dataclass(frozen=True)
class TrainingState:
    """The objects a checkpoint saves from and loads into. Loading changes their values in place."""

    module: torch.nn.Module
    """The wrapped model: its buffers and frozen tensors are saved whole, its parameters' names and shapes
    go into the manifest."""
    optimizer: torch.optim.Optimizer | None
    """None for an evaluation-only engine. Its per-parameter state travels with the stage's fp32 masters."""
    lr_scheduler: Stateful | None
    loss_scaler: Stateful | None
    """fp16's LossScaler (engine/precision/loss_scaler.py); None for bf16 and fp32."""
    stage: ZeroStage
    """Its checkpoint_shards() (what this rank holds, as named pieces: engine/zero/records.py) and its stage number
    (zero_optimization.stage, written into the manifest) are used."""
    model_dtype: torch.dtype | None
    """The training dtype the model was cast to; None: the model's own dtypes ("as built" in the manifest)."""
    counters: Counters
    parallel: ParallelGroups
    """The tensor- and data-parallel groups: a tensor-parallel rank's slices are saved under names of their
    own, replicated tensors by tensor-parallel rank 0 (engine/checkpoint/tensor_parallel.py)."""


@dataclass(frozen=True)
class LoadResult:
    path: str
    """The tag directory that was read."""
    client_state: dict[str, Any]
    """What save_checkpoint was given as client_state, rebuilt."""
    counters: Counters | None
    """The saved counters; None with load_module_only (the Engine keeps its own)."""
