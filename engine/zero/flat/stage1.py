"""Stage 1: optimizer state (and fp32 masters) partitioned; full parameters and gradients per rank.

Gradients accumulate in a full-size flat buffer and are reduce-scattered at the accumulation
boundary, overlapped with backward, into this rank's fp32 gradient rows (engine/zero/flat/boundary_reduced.py).
The optimizer steps this rank's shard; the updated slices are all-gathered back into every rank's
parameters (engine/zero/flat/stage.py).
"""

from __future__ import annotations

from engine.zero.flat.boundary_reduced import BoundaryReducedStage


class Stage1(BoundaryReducedStage):
    stage = 1
    partitioned = True
