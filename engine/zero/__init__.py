"""ZeRO stages and the stage-3 user API (`engine.zero.GatheredParameters`)."""

from engine.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]
