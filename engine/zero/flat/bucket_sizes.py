"""reduce_bucket_size and allgather_bucket_size when the config leaves them out: from the link.

DeepSpeed's defaults (5e8 elements, 2 GB of fp32) make one bucket of most models, so no gradient
reduction starts before the whole backward is done. Here the group's collective latency and
bandwidth are measured once at start (engine.comm.measure_link, a few ms) and the bucket is the
size whose transfer takes 19x the fixed latency: big enough that latency is 5% of a collective,
small enough that reductions start early in the backward. Config values always win; "auto" keeps
DeepSpeed's default (engine/config/auto.py).
"""

from __future__ import annotations

from engine import comm
from engine.config.types import DEEPSPEED_BUCKET_SIZE, ZeroConfig
from engine.monitor.log import get_logger

logger = get_logger()

LATENCY_SHARE = 0.05
MIN_BUCKET_BYTES, MAX_BUCKET_BYTES = 1 << 20, 256 << 20
FALLBACK_BUCKET_BYTES = 16 << 20
"""The bucket when no probe could be trusted: between what this formula gives on gloo over loopback
(3-8 MiB) and on NVLink-class links (tens of MiB)."""


def bucket_bytes(link: comm.LinkSpeed) -> int:
    """The bucket for which the fixed latency is LATENCY_SHARE of a collective's time: smaller
    buckets pay mostly latency, larger ones delay the first reduction (less overlap with backward)."""
    if link.rejected is not None:
        return FALLBACK_BUCKET_BYTES
    raw = link.latency_s * link.bandwidth_Bps * (1 - LATENCY_SHARE) / LATENCY_SHARE
    return int(min(max(raw, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES))


def reason(link: comm.LinkSpeed) -> str:
    """Why bucket_bytes(link) is what it is, for the log line."""
    if link.rejected is not None:
        return (
            f"the link measurement was implausible ({link.rejected}), so the fallback {FALLBACK_BUCKET_BYTES >> 20} MiB"
        )
    raw = link.latency_s * link.bandwidth_Bps * (1 - LATENCY_SHARE) / LATENCY_SHARE
    bound = (
        f", raised to the {MIN_BUCKET_BYTES >> 20} MiB minimum"
        if raw < MIN_BUCKET_BYTES
        else f", cut to the {MAX_BUCKET_BYTES >> 20} MiB maximum"
        if raw > MAX_BUCKET_BYTES
        else ""
    )
    return (
        f"from the measured link: latency {link.latency_s * 1e6:.0f} us, {link.bandwidth_Bps / 1e9:.2f} GB/s "
        f"per rank ({(1 - LATENCY_SHARE) / LATENCY_SHARE:.0f}x the latency's worth of bytes{bound})"
    )


def resolve(zero: ZeroConfig, element_size: int, dp_size: int, *, gathers: bool = True) -> tuple[int, int]:
    """(reduce_bucket_size, allgather_bucket_size) in elements of `element_size` bytes, for collectives
    over `dp_size` ranks. gathers=False (stage 0 all-gathers nothing): an unset allgather_bucket_size is
    neither measured nor logged. The link is measured over the world (every rank measures the same
    link; with tensor parallelism a data-parallel group spans the same machines or more)."""
    reduce, gather = zero.reduce_bucket_size, zero.allgather_bucket_size
    if not gathers:
        gather = gather or DEEPSPEED_BUCKET_SIZE
    if reduce is not None and gather is not None:
        return reduce, gather
    if dp_size == 1:  # nothing travels: one bucket is cheapest
        return reduce or DEEPSPEED_BUCKET_SIZE, gather or DEEPSPEED_BUCKET_SIZE
    link = comm.measure_link()
    measured = max(1, bucket_bytes(link) // element_size)
    chosen = (reduce or measured, gather or measured)
    if comm.get_rank() == 0:
        unset = [k for k, v in (("reduce_bucket_size", reduce), ("allgather_bucket_size", gather)) if v is None]
        logger.info(
            "bucket size %d elements (%.1f MiB) for %s: %s; set zero_optimization.%s to choose",
            measured,
            measured * element_size / 2**20,
            " and ".join(unset),
            reason(link),
            unset[0],
        )
    return chosen
