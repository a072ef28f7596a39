"""ZeRO stage 3: parameters, gradients and optimizer state partitioned; a unit's whole parameters exist
only while the modules that use it compute.

stage.py (Stage3) wires the parts and implements the stage interface: unit_plan.py decides which
parameters form a gather unit (and `engine.zero.set_z3_leaf_modules`), units.py holds the units as
data (sharded groups, UnitState), prefetch.py the pure prefetch plan, gather.py the gathers, releases
and forward hooks, grads.py the gradient buckets, memory.py where gathered buffers and buckets come
from, and memory_efficient_linear.py the linear that lets a released unit's buffer go.
"""

from engine.zero.stage3.stage import Stage3

__all__ = ["Stage3"]
