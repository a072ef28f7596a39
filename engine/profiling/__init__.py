"""Flops profiling: DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`) for this engine
and the peak that model-flops utilisation is relative to.

- flops_profiler.py: per-module forward flops, MACs, latency and parameters, counted by
  `torch.utils.flop_counter.FlopCounterMode` and forward hooks (FlopsProfiler, get_model_profile).
- report.py: those figures printed in DeepSpeed's layout, and DeepSpeed's number formats.
- step_profile.py: the `flops_profiler` config section at work in an Engine (one profiled step,
  then TFLOPs and MFU for the progress log and the monitors).
- peak.py: the measured peak FLOP/s of this process.

    from engine.profiling import get_model_profile
    flops, macs, params = get_model_profile(model, input_shape=(8, 512))
"""

from engine.profiling.flops_profiler import FlopsProfiler, ModuleProfile, get_model_profile
from engine.profiling.peak import measured_peak_flops

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "measured_peak_flops"]
