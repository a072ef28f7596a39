"""Stage 1: optimizer state (and fp32 masters) partitioned; full parameters and gradients per rank.

Gradients accumulate in a full-size flat buffer and are reduce-scattered at the accumulation
boundary, overlapped with backward, into this rank's fp32 gradient rows (engine/zero/boundary_reduced.py).
The optimizer steps this rank's shard; the updated slices are all-gathered back into every rank's
parameters (engine/zero/flat_stage.py).
"""

from __future__ import annotations

import torch

from engine.config.types import EngineConfig
from engine.precision import Precision
from engine.zero.boundary_reduced import BoundaryReducedStage
from engine.zero.flat_groups import bind_optimizer_to_shards


class Stage1(BoundaryReducedStage):
    stage = 1
    partitioned = True

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: EngineConfig,
                 precision: Precision) -> None:
        self._config = config
        super().__init__(module, optimizer, config, precision)

    def _bind_optimizer(self) -> None:
        self._offload = bind_optimizer_to_shards(self._optimizer, self.groups, self._config)
