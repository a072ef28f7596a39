"""`deepspeed.runtime.zero.offload_config` -> engine.zero.offload_states (the names engine.offload_states takes)."""

from engine.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
