"""ZeRO stages and the stage-3 user API (`engine.zero.GatheredParameters`, `engine.zero.Init`)."""

from engine.zero.gathered import GatheredParameters
from engine.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
