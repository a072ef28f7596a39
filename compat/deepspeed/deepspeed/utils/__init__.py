"""`deepspeed.utils` -> the engine's logger and stage-3 leaf-module registry."""

from engine.comm import is_initialized
from engine.monitor.log import get_logger as _get_logger
from engine.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

logger = _get_logger()

__all__ = ["get_z3_leaf_modules", "is_initialized", "logger", "set_z3_leaf_modules", "unset_z3_leaf_modules"]
