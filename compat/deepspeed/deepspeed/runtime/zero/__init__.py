"""`deepspeed.runtime.zero` -> engine.zero."""

from deepspeed.runtime.zero import partition_parameters
from engine.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
