"""`deepspeed.runtime.engine` -> engine.runtime.engine (isinstance checks against DeepSpeedEngine)."""

from engine.runtime.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
