"""The flat-buffer layout shared by every ZeRO stage and by checkpointing.

# [Note: the flat layout]
# A *group* (one optimizer param group and one dtype for stages 0-2; a gather unit for stage 3)
# lays its parameters end to end in one flat buffer, in gradient-arrival order, with no padding
# between parameters. The buffer is cut into `num_buckets` buckets of exactly `bucket_numel`
# elements each; `bucket_numel` is a multiple of world_size x align (align = 128 bytes' worth of
# elements), so every bucket splits into world_size equal, aligned *slices*, and all padding sits
# at the end of the last bucket. Rank r owns slice r of every bucket; its *shard* is those slices
# in bucket order, `shard_numel = num_buckets x slice_numel` elements.
#
# Equal buckets are the point: rank r's slices then sit at a constant stride in the flat buffer,
# so its shard is one strided view `(num_buckets, slice_numel)` of the buffer. In fp32 training
# that view *is* the master copy the optimizer updates in place (no second fp32 copy, unlike
# DeepSpeed's 12 Psi/N bytes), and after the step each bucket is all-gathered in place. A
# parameter may straddle a bucket boundary; the stages handle a gradient that spans buckets.
#
# Everything here is pure arithmetic on shapes: no tensors
# are allocated, so checkpoint tools can rebuild any rank's layout from a manifest.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ALIGN_BYTES = 128
"""Slices start on 128-byte boundaries (cache lines, vector loads, NCCL's preferred alignment)."""


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in its group's flat buffer."""

    index: int
    """Position in the group's parameter list (arrival order)."""
    shape: tuple[int, ...]
    offset: int
    """First element in the flat buffer."""
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """A run of consecutive elements of one parameter held contiguously in one rank's shard."""

    param: int
    """Index of the parameter in the group."""
    param_offset: int
    """First element within the (flattened) parameter."""
    shard_offset: int
    """First element within the rank's shard."""
    numel: int


@dataclass(frozen=True)
class GroupLayout:
    """One group's flat buffer: params end to end, equal buckets, one slice per rank per bucket."""

    world_size: int
    align: int
    """Elements per 128 bytes for this dtype; slices are multiples of it."""
    bucket_numel: int
    """Elements per bucket, padding included: a multiple of world_size x align."""
    num_buckets: int
    params: tuple[ParamSpan, ...]

    # ------------------------------------------------------------------------------- sizes
    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return self.params[-1].end if self.params else 0

    @property
    def padded_numel(self) -> int:
        return self.num_buckets * self.bucket_numel

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def slice_numel(self) -> int:
        return self.bucket_numel // self.world_size

    @property
    def shard_numel(self) -> int:
        return self.num_buckets * self.slice_numel

    # ------------------------------------------------------------------------------ ranges
    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """[start, end) of a bucket in the flat buffer."""
        self._check_bucket(bucket)
        start = bucket * self.bucket_numel
        return start, start + self.bucket_numel

    def slice_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """[start, end) in the flat buffer of rank's slice of a bucket."""
        self._check_bucket(bucket)
        self._check_rank(rank)
        start = bucket * self.bucket_numel + rank * self.slice_numel
        return start, start + self.slice_numel

    def buckets_of(self, param: int) -> range:
        """Buckets a parameter overlaps (empty for a zero-element parameter)."""
        span = self.params[param]
        if span.numel == 0:
            return range(0)
        return range(span.offset // self.bucket_numel, (span.end - 1) // self.bucket_numel + 1)

    def params_in(self, bucket: int) -> range:
        """Indices of the parameters with at least one element in a bucket."""
        start, end = self.bucket_range(bucket)
        ends = [p.end for p in self.params]
        first = bisect.bisect_right(ends, start)  # first param ending after `start`
        last = first
        while last < len(self.params) and self.params[last].offset < end:
            last += 1
        return range(first, last)

    # ----------------------------------------------------------------------- element lookup
    def locate(self, param: int, element: int) -> tuple[int, int]:
        """(rank, shard offset) of element `element` of parameter `param` (flattened)."""
        span = self.params[param]
        if not 0 <= element < span.numel:
            raise IndexError(f"element {element} out of range for parameter {param} of {span.numel} elements")
        flat = span.offset + element
        bucket, within = divmod(flat, self.bucket_numel)
        rank, in_slice = divmod(within, self.slice_numel)
        return rank, bucket * self.slice_numel + in_slice

    def element_at(self, rank: int, shard_offset: int) -> tuple[int, int] | None:
        """(param, element) stored at a shard offset of rank, or None for padding."""
        self._check_rank(rank)
        if not 0 <= shard_offset < self.shard_numel:
            raise IndexError(f"shard offset {shard_offset} out of range for a shard of {self.shard_numel}")
        bucket, in_slice = divmod(shard_offset, self.slice_numel)
        flat = bucket * self.bucket_numel + rank * self.slice_numel + in_slice
        if flat >= self.numel:
            return None
        index = bisect.bisect_right([p.offset for p in self.params], flat) - 1
        while self.params[index].numel == 0 or flat >= self.params[index].end:  # skip empty params
            index += 1
        return index, flat - self.params[index].offset

    def rank_pieces(self, rank: int) -> list[Piece]:
        """Every run of parameter elements rank holds, in shard order (padding omitted)."""
        self._check_rank(rank)
        pieces: list[Piece] = []
        for bucket in range(self.num_buckets):
            lo, hi = self.slice_range(bucket, rank)
            shard_base = bucket * self.slice_numel - lo  # flat position -> shard offset
            for i in self.params_in(bucket):
                span = self.params[i]
                start, end = max(lo, span.offset), min(hi, span.end)
                if start < end:
                    pieces.append(Piece(i, start - span.offset, start + shard_base, end - start))
        return pieces

    def param_pieces(self, param: int) -> list[tuple[int, Piece]]:
        """(rank, piece) for every run of a parameter's elements, in element order."""
        span = self.params[param]
        out: list[tuple[int, Piece]] = []
        pos = span.offset
        while pos < span.end:
            bucket, within = divmod(pos, self.bucket_numel)
            rank, in_slice = divmod(within, self.slice_numel)
            run = min(span.end, bucket * self.bucket_numel + (rank + 1) * self.slice_numel) - pos
            out.append((rank, Piece(param, pos - span.offset, bucket * self.slice_numel + in_slice, run)))
            pos += run
        return out

    # ---------------------------------------------------------------------------- checks
    def _check_bucket(self, bucket: int) -> None:
        if not 0 <= bucket < self.num_buckets:
            raise IndexError(f"bucket {bucket} out of range ({self.num_buckets} buckets)")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world size {self.world_size}")


def align_elements(element_size: int) -> int:
    """Elements per ALIGN_BYTES for a dtype of element_size bytes."""
    return max(1, ALIGN_BYTES // element_size)


def build_layout(
    shapes: Sequence[Iterable[int]], *, world_size: int, bucket_size: int, element_size: int
) -> GroupLayout:
    """Lay out parameters of the given shapes (in arrival order) for world_size ranks.

    bucket_size is the target elements per bucket (reduce_bucket_size): ceil(total / bucket_size)
    equal buckets, each rounded up to a multiple of world_size x align, so padding is at most that
    multiple per bucket. When the rounding adds up to whole buckets (small buckets, many ranks),
    those trailing all-padding buckets are dropped, so all padding sits in the last bucket.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_size}")
    align = align_elements(element_size)
    spans: list[ParamSpan] = []
    offset = 0
    for i, shape in enumerate(shapes):
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        spans.append(ParamSpan(i, shape, offset, numel))
        offset += numel
    total = offset
    unit = world_size * align
    num_buckets = max(1, math.ceil(total / bucket_size))
    bucket_numel = max(unit, math.ceil(math.ceil(total / num_buckets) / unit) * unit)
    num_buckets = max(1, math.ceil(total / bucket_numel))  # no bucket of nothing but padding
    return GroupLayout(world_size, align, bucket_numel, num_buckets, tuple(spans))
