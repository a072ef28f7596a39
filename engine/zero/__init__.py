"""ZeRO stages and the stage-3 user API (`engine.zero.GatheredParameters`, `engine.zero.Init`,
`engine.zero.set_z3_leaf_modules`)."""

from engine.zero.gathered import GatheredParameters
from engine.zero.partitioned_init import Init
from engine.zero.units import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

__all__ = ["GatheredParameters", "Init", "get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules"]
