"""DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`) for this engine: per-module
forward flops, MACs, latency and parameters, counted by `torch.utils.flop_counter.FlopCounterMode`
and printed in DeepSpeed's layout, plus the measured peak FLOP/s that model-flops utilisation is
relative to.

    from engine.profiling import get_model_profile
    flops, macs, params = get_model_profile(model, input_shape=(8, 512))
"""

from engine.profiling.flops_profiler import FlopsProfiler, ModuleProfile, get_model_profile
from engine.profiling.peak import measured_peak_flops

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "measured_peak_flops"]
