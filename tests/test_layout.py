"""The flat-buffer layout (engine/zero/layout.py, [Note: the flat layout]): property tests over random shapes.

Every property is checked against random groups: lists of parameter shapes (scalars, 0- and 1-element
params, up to a few thousand elements each), world sizes 1..8, target bucket sizes 1..5000 and
element sizes 1, 2, 4, 8 bytes. The examples at the end pin down a few layouts worked out by hand.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.zero.layout import ALIGN_BYTES, GroupLayout, Piece, align_elements, build_layout

ELEMENT_SIZES = (1, 2, 4, 8)
DTYPES = {1: torch.int8, 2: torch.float16, 4: torch.float32, 8: torch.float64}
MAX_PARAM_NUMEL = 4096


@st.composite
def shapes_st(draw: st.DrawFn, max_dim: int = MAX_PARAM_NUMEL) -> tuple[int, ...]:
    """A shape of 0..3 dims with at most MAX_PARAM_NUMEL elements; dims of 0 and 1 are common."""
    ndim = draw(st.integers(0, 3))
    shape: list[int] = []
    bound = MAX_PARAM_NUMEL
    for _ in range(ndim):
        dim = draw(st.one_of(st.sampled_from((0, 1)), st.integers(0, max(1, min(max_dim, bound)))))
        shape.append(dim)
        bound = max(1, bound // max(1, dim))
    return tuple(shape)


@st.composite
def layouts(draw: st.DrawFn, max_params: int = 6) -> tuple[GroupLayout, list[tuple[int, ...]], int]:
    shapes = draw(st.lists(shapes_st(), max_size=max_params))
    world_size = draw(st.integers(1, 8))
    bucket_size = draw(st.one_of(st.integers(1, 64), st.integers(1, 5000)))
    element_size = draw(st.sampled_from(ELEMENT_SIZES))
    layout = build_layout(shapes, world_size=world_size, bucket_size=bucket_size, element_size=element_size)
    return layout, shapes, bucket_size


def _check_piece(layout: GroupLayout, piece: Piece) -> None:
    assert piece.numel > 0
    span = layout.params[piece.param]
    assert 0 <= piece.param_offset and piece.param_offset + piece.numel <= span.numel
    assert 0 <= piece.shard_offset and piece.shard_offset + piece.numel <= layout.shard_numel


# --------------------------------------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None)
@given(layouts())
def test_rank_pieces_cover_every_element_once(case: tuple[GroupLayout, list, int]) -> None:
    layout, shapes, _ = case
    counts = [np.zeros(math.prod(s), dtype=np.int64) for s in shapes]
    for rank in range(layout.world_size):
        pieces = layout.rank_pieces(rank)
        occupied = np.zeros(layout.shard_numel, dtype=np.int64)
        for piece in pieces:
            _check_piece(layout, piece)
            counts[piece.param][piece.param_offset : piece.param_offset + piece.numel] += 1
            occupied[piece.shard_offset : piece.shard_offset + piece.numel] += 1
            # Both ends of the run hold the elements the piece says they do.
            last = piece.numel - 1
            assert layout.element_at(rank, piece.shard_offset) == (piece.param, piece.param_offset)
            assert layout.element_at(rank, piece.shard_offset + last) == (piece.param, piece.param_offset + last)
        assert occupied.max(initial=0) <= 1, "pieces of one shard overlap"
        offsets = [p.shard_offset for p in pieces]
        assert offsets == sorted(offsets), "rank_pieces not in shard order"
        assert sum(p.numel for p in pieces) == int(occupied.sum())
    for c in counts:
        assert (c == 1).all(), "some element is held by no rank or by several"


@settings(max_examples=150, deadline=None)
@given(layouts(), st.randoms(use_true_random=False))
def test_locate_element_at_round_trip(case: tuple[GroupLayout, list, int], rnd: random.Random) -> None:
    layout, _, _ = case
    nonempty = [s.index for s in layout.params if s.numel > 0]
    for _ in range(50 if nonempty else 0):
        param = rnd.choice(nonempty)
        numel = layout.params[param].numel
        element = rnd.choice((0, numel - 1, rnd.randrange(numel)))
        rank, shard_offset = layout.locate(param, element)
        assert 0 <= rank < layout.world_size and 0 <= shard_offset < layout.shard_numel
        assert layout.element_at(rank, shard_offset) == (param, element)
    # Every shard position is either one real element or padding: real positions number layout.numel.
    real = 0
    for rank in range(layout.world_size):
        for shard_offset in range(layout.shard_numel):
            found = layout.element_at(rank, shard_offset)
            if found is None:
                continue
            real += 1
            param, element = found
            assert 0 <= element < layout.params[param].numel
            assert layout.locate(param, element) == (rank, shard_offset)
    assert real == layout.numel
    assert layout.world_size * layout.shard_numel - real == layout.padding


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_param_pieces_agree_with_rank_pieces(case: tuple[GroupLayout, list, int]) -> None:
    layout, _, _ = case
    by_param: dict[int, set[tuple[int, Piece]]] = {s.index: set() for s in layout.params}
    for rank in range(layout.world_size):
        for piece in layout.rank_pieces(rank):
            by_param[piece.param].add((rank, piece))
    for span in layout.params:
        pieces = layout.param_pieces(span.index)
        assert set(pieces) == by_param[span.index]
        assert len(pieces) == len(by_param[span.index])
        expected_offset = 0
        for rank, piece in pieces:  # element order, contiguous, ending at the parameter's end
            assert 0 <= rank < layout.world_size
            assert piece.param == span.index
            _check_piece(layout, piece)
            assert piece.param_offset == expected_offset
            expected_offset += piece.numel
        assert expected_offset == span.numel


@settings(max_examples=300, deadline=None)
@given(layouts(max_params=10))
def test_structure(case: tuple[GroupLayout, list, int]) -> None:
    layout, shapes, bucket_size = case
    unit = layout.world_size * layout.align
    # Params end to end, in order, no gaps.
    offset = 0
    for i, (span, shape) in enumerate(zip(layout.params, shapes, strict=True)):
        assert span.index == i and span.shape == tuple(shape) and span.numel == math.prod(shape)
        assert span.offset == offset
        offset = span.end
    assert layout.numel == offset == sum(math.prod(s) for s in shapes)
    # Equal buckets of a whole number of aligned slices.
    assert layout.bucket_numel > 0 and layout.bucket_numel % unit == 0
    assert layout.slice_numel * layout.world_size == layout.bucket_numel
    assert layout.slice_numel % layout.align == 0
    assert layout.shard_numel == layout.num_buckets * layout.slice_numel
    assert layout.padded_numel == layout.num_buckets * layout.bucket_numel >= layout.numel
    # A bucket is never bigger than the target bucket size rounded up to a whole unit.
    assert layout.bucket_numel <= max(unit, math.ceil(bucket_size / unit) * unit)
    # Padding: at most one unit per bucket (strictly less, unless the group has no elements, where the one
    # bucket is a whole unit of padding).
    if layout.numel > 0:
        assert layout.padding < layout.num_buckets * unit
    else:
        assert layout.num_buckets == 1 and layout.padding == layout.bucket_numel == unit
    # Bucket count: ceil(numel / bucket_size) target buckets, but never a bucket made only of padding, so
    # all padding sits at the end of the last bucket (the Note).
    assert 1 <= layout.num_buckets <= max(1, math.ceil(layout.numel / bucket_size))
    assert layout.num_buckets == max(1, math.ceil(layout.numel / layout.bucket_numel))
    assert layout.padding < layout.bucket_numel or layout.numel == 0
    # Slices tile each bucket; buckets tile the buffer.
    for b in range(layout.num_buckets):
        start, end = layout.bucket_range(b)
        assert (start, end) == (b * layout.bucket_numel, (b + 1) * layout.bucket_numel)
        pos = start
        for rank in range(layout.world_size):
            lo, hi = layout.slice_range(b, rank)
            assert lo == pos and hi - lo == layout.slice_numel
            pos = hi
        assert pos == end
    # buckets_of / params_in agree, and match the spans.
    for span in layout.params:
        buckets = layout.buckets_of(span.index)
        if span.numel == 0:
            assert len(buckets) == 0
            continue
        expected = [
            b
            for b in range(layout.num_buckets)
            if span.offset < (b + 1) * layout.bucket_numel and b * layout.bucket_numel < span.end
        ]
        assert list(buckets) == expected
        for b in range(layout.num_buckets):
            assert (span.index in layout.params_in(b)) == (b in buckets)
    for b in range(layout.num_buckets):
        start, end = layout.bucket_range(b)
        for i in layout.params_in(b):  # a range: zero-element params between real ones may sit inside it
            span = layout.params[i]
            assert span.numel == 0 or (span.offset < end and start < span.end)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1))
def test_strided_shard_views_hold_the_pieces(case: tuple[GroupLayout, list, int], seed: int) -> None:
    layout, shapes, _ = case
    dtype = DTYPES[ALIGN_BYTES // layout.align]
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    else:
        params = [torch.randint(-128, 128, s, generator=gen, dtype=dtype) for s in shapes]
    flat = torch.full((layout.padded_numel,), 7, dtype=dtype)
    for span, p in zip(layout.params, params, strict=True):
        flat[span.offset : span.end] = p.reshape(-1)
    held = 0
    for rank in range(layout.world_size):
        view = flat.as_strided(
            (layout.num_buckets, layout.slice_numel), (layout.bucket_numel, 1), rank * layout.slice_numel
        )
        shard = view.reshape(-1)
        assert shard.numel() == layout.shard_numel
        for piece in layout.rank_pieces(rank):
            expected = params[piece.param].reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
            assert torch.equal(shard[piece.shard_offset : piece.shard_offset + piece.numel], expected)
            held += piece.numel
        # Writing through the view reaches the flat buffer (the shard is the optimizer's master copy).
        view.add_(0)
    assert held == layout.numel
    for span, p in zip(layout.params, params, strict=True):
        assert torch.equal(flat[span.offset : span.end], p.reshape(-1))
    # Everything past the last parameter is padding, untouched.
    assert (flat[layout.numel :] == 7).all()


# ----------------------------------------------------------------------------------------------- examples
def test_align_elements() -> None:
    assert [align_elements(s) for s in (1, 2, 4, 8)] == [128, 64, 32, 16]
    assert align_elements(256) == 1


def test_example_small_group_is_one_bucket() -> None:
    # 17 elements, target 8 per bucket -> ceil(17/8) = 3 target buckets of ceil(17/3) = 6 elements, each rounded
    # up to world_size x align = 2 x 32 = 64. One 64-element bucket already holds everything, so it is the only
    # bucket: 47 elements of padding at the end of it, not two more buckets of nothing but padding.
    layout = build_layout([(3, 4), (5,)], world_size=2, bucket_size=8, element_size=4)
    assert layout.align == 32
    assert (layout.bucket_numel, layout.num_buckets, layout.slice_numel) == (64, 1, 32)
    assert (layout.numel, layout.padded_numel, layout.padding, layout.shard_numel) == (17, 64, 47, 32)
    assert [(s.offset, s.numel) for s in layout.params] == [(0, 12), (12, 5)]
    assert layout.rank_pieces(0) == [Piece(0, 0, 0, 12), Piece(1, 0, 12, 5)]
    assert layout.rank_pieces(1) == []
    assert layout.param_pieces(1) == [(0, Piece(1, 0, 12, 5))]
    assert layout.locate(1, 4) == (0, 16)
    assert layout.element_at(0, 16) == (1, 4)
    assert layout.element_at(0, 17) is None
    assert layout.element_at(1, 0) is None


def test_example_param_straddles_buckets_and_ranks() -> None:
    # 150 elements, target 100 -> 2 buckets of ceil(150/2) = 75 -> 128 (unit 2 x 32); slices of 64.
    layout = build_layout([(100,), (5, 10)], world_size=2, bucket_size=100, element_size=4)
    assert (layout.bucket_numel, layout.num_buckets, layout.slice_numel, layout.padding) == (128, 2, 64, 106)
    assert layout.slice_range(1, 0) == (128, 192)
    # bucket 0: rank 0 = param 0 [0, 64); rank 1 = param 0 [64, 100) + param 1 [0, 28)
    # bucket 1: rank 0 = param 1 [28, 50) + padding; rank 1 = padding
    assert layout.rank_pieces(0) == [Piece(0, 0, 0, 64), Piece(1, 28, 64, 22)]
    assert layout.rank_pieces(1) == [Piece(0, 64, 0, 36), Piece(1, 0, 36, 28)]
    assert layout.param_pieces(0) == [(0, Piece(0, 0, 0, 64)), (1, Piece(0, 64, 0, 36))]
    assert layout.param_pieces(1) == [(1, Piece(1, 0, 36, 28)), (0, Piece(1, 28, 64, 22))]
    assert list(layout.buckets_of(0)) == [0] and list(layout.buckets_of(1)) == [0, 1]
    assert list(layout.params_in(0)) == [0, 1] and list(layout.params_in(1)) == [1]
    assert layout.locate(1, 30) == (0, 66)
    assert layout.element_at(0, 66) == (1, 30)
    assert layout.element_at(0, 86) is None  # param 1 ends at shard offset 64 + 22
    assert layout.element_at(1, 64) is None


def test_example_world_size_one_and_odd_params() -> None:
    # Scalars, empty and 1-element params; one rank, bytes (align 128), target bucket 5000.
    layout = build_layout([(), (0,), (1,), (2, 0), (3,)], world_size=1, bucket_size=5000, element_size=1)
    assert [(s.offset, s.numel) for s in layout.params] == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 3)]
    assert (layout.bucket_numel, layout.num_buckets, layout.numel, layout.padding) == (128, 1, 5, 123)
    assert layout.rank_pieces(0) == [Piece(0, 0, 0, 1), Piece(2, 0, 1, 1), Piece(4, 0, 2, 3)]
    assert layout.param_pieces(1) == [] and list(layout.buckets_of(3)) == []
    assert [layout.element_at(0, i) for i in range(6)] == [(0, 0), (2, 0), (4, 0), (4, 1), (4, 2), None]


def test_example_empty_group() -> None:
    layout = build_layout([], world_size=4, bucket_size=10, element_size=2)
    assert (layout.numel, layout.num_buckets, layout.bucket_numel, layout.padding) == (0, 1, 256, 256)
    assert all(layout.rank_pieces(r) == [] for r in range(4))
    assert layout.element_at(3, layout.shard_numel - 1) is None
    assert list(layout.params_in(0)) == []


# ------------------------------------------------------------------------------------------------- errors
def test_out_of_range_raises_index_error() -> None:
    layout = build_layout([(3, 4), (5,)], world_size=2, bucket_size=8, element_size=4)
    for rank in (-1, 2):
        with pytest.raises(IndexError):
            layout.rank_pieces(rank)
        with pytest.raises(IndexError):
            layout.element_at(rank, 0)
        with pytest.raises(IndexError):
            layout.slice_range(0, rank)
    for bucket in (-1, layout.num_buckets):
        with pytest.raises(IndexError):
            layout.bucket_range(bucket)
        with pytest.raises(IndexError):
            layout.slice_range(bucket, 0)
        with pytest.raises(IndexError):
            layout.params_in(bucket)
    for element in (-1, 5):
        with pytest.raises(IndexError):
            layout.locate(1, element)
    for offset in (-1, layout.shard_numel):
        with pytest.raises(IndexError):
            layout.element_at(0, offset)
    with pytest.raises(IndexError):
        build_layout([(0,)], world_size=1, bucket_size=1, element_size=4).locate(0, 0)


@pytest.mark.parametrize(("world_size", "bucket_size"), [(0, 8), (-1, 8), (2, 0), (2, -5)])
def test_bad_sizes_raise_value_error(world_size: int, bucket_size: int) -> None:
    with pytest.raises(ValueError):
        build_layout([(3,)], world_size=world_size, bucket_size=bucket_size, element_size=4)
