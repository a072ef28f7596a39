"""ZeRO stages 0, 1 and 2: every rank holds whole parameters in flat, bucketed buffers.

stage.py (FlatStage) is what the three share: flat groups, buckets reduced in one global launch order,
the optimizer step on the reduced gradient rows and, when partitioned, the all-gather of the updated
slices. boundary_reduced.py (stages 0 and 1) reduces one full-size gradient buffer at the accumulation
boundary; stage2.py fills bucket buffers from hooks and reduces them every micro-step. bucket_sizes.py
sizes the buckets from the measured link when the config does not. forward_only.py is the stage of an
engine without an optimizer at stages 0-2 (nothing to partition).
"""

from engine.zero.flat.forward_only import ForwardOnly
from engine.zero.flat.stage0 import Stage0
from engine.zero.flat.stage1 import Stage1
from engine.zero.flat.stage2 import Stage2

__all__ = ["ForwardOnly", "Stage0", "Stage1", "Stage2"]
