"""`deepspeed.zero` -> engine.zero."""

from engine.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
