"""`deepspeed.runtime.base_optimizer` -> engine.runtime.zero_optimizer: the optimizer engine.initialize returns is
an instance of DeepSpeedOptimizer (Lightning Fabric's load_checkpoint checks
`isinstance(item, (Optimizer, DeepSpeedOptimizer))`)."""

from engine.runtime.zero_optimizer import DeepSpeedOptimizer

__all__ = ["DeepSpeedOptimizer"]
