"""The FLOP/s this process reaches on a large matmul: the denominator of model-flops utilisation."""

from __future__ import annotations

import time

import torch

_PROBE_SECONDS = 0.2
_SIZE = {"cpu": 1024}
"""Square matmul size per device type: large enough to saturate it (a 1024^3 CPU matmul is ~2 GFLOP
over all intra-op threads); any other device type (CUDA) uses _LARGE_SIZE."""
_LARGE_SIZE = 8192
_CACHE: dict[tuple[torch.dtype, str, int], float] = {}
"""(dtype, device, torch.get_num_threads()) -> measured FLOP/s: the probe runs once per key."""


def measured_peak_flops(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> float:
    """FLOP/s of a square `dtype` matmul on `device`, measured in this process: a warm-up, then
    repeated for about 0.2 s, the best rate kept. Cached per (dtype, device, intra-op thread count).

    This is what this process can reach with the threads it was given (a CPU rank sharing the cores
    with other ranks gets its share), not the machine's datasheet peak: MFU against it says how much
    of the reachable throughput the training step uses, and is comparable between CPU runs whose
    thread counts differ. On a GPU it sits below the datasheet figure (clocks, power, tile effects)."""
    if not dtype.is_floating_point:
        raise TypeError(f"measured_peak_flops: dtype must be a floating-point dtype, got {dtype}")
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    key = (dtype, str(where), torch.get_num_threads())
    if key not in _CACHE:
        _CACHE[key] = _probe(dtype, where, _SIZE.get(where.type, _LARGE_SIZE), _PROBE_SECONDS)
    return _CACHE[key]


def _probe(dtype: torch.dtype, device: torch.device, size: int, seconds: float) -> float:
    """Best FLOP/s over timed `size`^3 matmuls for about `seconds` (at least one timed call)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    flops = 2.0 * size**3

    def timed() -> float:
        _synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _synchronize(device)  # a CUDA matmul only queues: wait for it to finish
        return time.perf_counter() - start

    timed()  # warm-up: thread pools, kernel selection, first-touch of the pages
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        best = max(best, flops / max(timed(), 1e-9))
        if time.perf_counter() >= deadline:
            return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
