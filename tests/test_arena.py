"""The memory arena (engine/ops/arena.py, csrc/cpu/arena.cpp), compiled and on the torch fallback.

The compiled runs set ZERO_ENGINE_OPS=require, so a broken build fails them instead of quietly testing
the fallback twice. The randomised workload runs the arena under test in lockstep with TorchArena (the
reference with the same algorithm): offsets, stats and error messages must agree at every step.
"""

from __future__ import annotations

import ctypes
import gc
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from engine.ops import builder
from engine.ops.arena import BLOCK_ALIGN, Arena, TorchArena

KEY = "zero_optimization.test_arena_bytes"
DTYPES = [
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
    torch.complex64,
]


@pytest.fixture(params=["compiled", "fallback"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(builder.ENV_MODE, "require" if request.param == "compiled" else "fallback")
    builder.reset_for_tests()
    yield request.param
    builder.reset_for_tests()


def make(impl: str, capacity: int, key: str = KEY) -> Arena:
    arena = Arena(capacity, key)
    assert arena.compiled == (impl == "compiled")
    return arena


def block_of(nbytes: int) -> int:
    return (nbytes + BLOCK_ALIGN - 1) // BLOCK_ALIGN * BLOCK_ALIGN


def assert_coalesced(stats: dict, capacity: int) -> None:
    assert stats["in_use"] == 0 and stats["allocations"] == 0, stats
    assert stats["free_blocks"] == 1 and stats["largest_free"] == capacity, stats
    assert stats["fragmentation"] == 0.0, stats


# ------------------------------------------------------------------------------- randomised workload
@dataclass
class Live:
    tensor: torch.Tensor  # what the test holds: the allocated tensor, or only a view of all of it
    mirror: torch.Tensor  # the same request's tensor from the reference arena
    pattern: bytes  # what its bytes must hold
    block: int  # bytes the arena took for it


class ArenaWorkload(RuleBasedStateMachine):
    capacity = 256 << 10  # a few 0..64 KiB requests fill it, so refusals and fragmentation happen

    def __init__(self, impl: str) -> None:
        super().__init__()
        self.arena = make(impl, self.capacity)
        self.reference = TorchArena(self.capacity, KEY)
        self.live: list[Live] = []
        self.serial = 0

    @rule(nbytes=st.integers(0, 64 << 10), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 3))
    def allocate(self, nbytes: int, dtype: torch.dtype, rows: int) -> None:
        numel = nbytes // dtype.itemsize // rows
        shape = [numel] if rows == 1 else [rows, numel]
        nbytes = rows * numel * dtype.itemsize
        before = self.arena.stats()
        try:
            tensor = self.arena.allocate(shape, dtype)
        except RuntimeError as error:
            # Refused only when no free block fits, with the reference's message, changing nothing.
            assert before["largest_free"] < block_of(nbytes), (before, nbytes)
            with pytest.raises(RuntimeError) as expected:
                self.reference.allocate(shape, dtype)
            assert str(error) == str(expected.value)
            assert KEY in str(error) and self.arena.stats() == before
            return
        mirror = self.reference.allocate(shape, dtype)
        assert tensor.shape == torch.Size(shape) and tensor.dtype == dtype and tensor.is_contiguous()
        self.serial += 1
        pattern = bytes((i * 7 + self.serial * 13) % 251 for i in range(nbytes))
        if nbytes:
            tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(pattern), dtype=torch.uint8))
            assert tensor.data_ptr() - self.arena.data_ptr() == mirror.data_ptr() - self.reference.data_ptr()
        self.live.append(Live(tensor, mirror, pattern, block_of(nbytes) if nbytes else 0))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def free(self, pick: int) -> None:
        self.live.pop(pick % len(self.live))  # the last references go: the blocks return

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def keep_only_a_view(self, pick: int) -> None:
        # The returned tensor object dies but a view keeps its storage: the block must stay taken.
        live = self.live[pick % len(self.live)]
        live.tensor = live.tensor.view(-1)

    @invariant()
    def blocks_hold_their_data_inside_the_arena(self) -> None:
        stats = self.arena.stats()
        assert stats == self.reference.stats()
        taken = sorted((live.tensor.data_ptr(), live.block) for live in self.live if live.block)
        assert stats["in_use"] == sum(block for _, block in taken) <= stats["capacity"]
        assert stats["allocations"] == len(taken) and stats["peak_in_use"] >= stats["in_use"]
        start, end = self.arena.data_ptr(), self.arena.data_ptr() + stats["capacity"]
        for (ptr, block), (next_ptr, _) in zip(taken, taken[1:] + [(end, 0)]):
            assert ptr % BLOCK_ALIGN == 0 and start <= ptr and ptr + block <= next_ptr, (ptr, block, next_ptr)
        for live in self.live:
            if live.block:
                assert ctypes.string_at(live.tensor.data_ptr(), len(live.pattern)) == live.pattern

    def teardown(self) -> None:
        self.live.clear()
        assert_coalesced(self.arena.stats(), self.capacity)
        assert_coalesced(self.reference.stats(), self.capacity)


def test_random_workload_keeps_data_and_coalesces(impl: str) -> None:
    run_state_machine_as_test(
        lambda: ArenaWorkload(impl), settings=settings(max_examples=40, stateful_step_count=40, deadline=None)
    )


# ------------------------------------------------------------------------------ placement and errors
def test_best_fit_takes_the_smallest_hole(impl: str) -> None:
    arena = make(impl, 16 * 64)
    blocks = [arena.allocate([size], torch.uint8) for size in (64, 192, 64, 128, 64)]
    offset = [t.data_ptr() - arena.data_ptr() for t in blocks]
    assert offset == [0, 64, 256, 320, 448]
    del blocks[3], blocks[1]  # holes: 192 bytes at 64, 128 at 320, 512 at the end
    assert arena.stats()["free_blocks"] == 3
    assert arena.allocate([100], torch.uint8).data_ptr() - arena.data_ptr() == 320  # not 64 (first fit)


def test_request_too_large_names_request_state_and_config_key(impl: str) -> None:
    arena = make(impl, 1 << 20, "zero_optimization.stage3_arena_bytes")
    held = arena.allocate([1000], torch.float32)  # 4000 bytes, a 4032-byte block
    before = arena.stats()
    with pytest.raises(RuntimeError) as error:
        arena.allocate([1024, 512], torch.float32)
    assert str(error.value) == (
        "Arena: cannot allocate a tensor of shape [1024, 512] and dtype torch.float32 (2097152 bytes, a "
        "2097152-byte block): capacity 1048576 bytes, 4032 in use, largest free block 1044544 bytes. Raise "
        "zero_optimization.stage3_arena_bytes (the arena's capacity in bytes)."
    )
    assert arena.stats() == before and held.numel() == 1000


def test_try_allocate_gives_none_where_allocate_refuses(impl: str) -> None:
    arena = make(impl, 16 * 64)
    held = arena.try_allocate([600], torch.uint8)  # a 640-byte block
    assert held is not None and held.data_ptr() == arena.data_ptr()
    before = arena.stats()
    assert arena.try_allocate([600], torch.uint8) is None and arena.stats() == before  # 384 bytes left
    assert arena.try_allocate([384], torch.uint8) is not None


def test_fragmented_refusal_says_so_and_coalescing_heals_it(impl: str) -> None:
    arena = make(impl, 4096)
    quarters = [arena.allocate([1024], torch.uint8) for _ in range(4)]
    del quarters[2], quarters[0]  # 2048 bytes free, as two 1024-byte holes
    stats = arena.stats()
    assert stats["fragmentation"] == 0.5 and stats["largest_free"] == 1024
    with pytest.raises(RuntimeError, match=r"2048 bytes free but fragmented into 2 blocks\)\. Raise " + KEY):
        arena.allocate([512], torch.float32)
    del quarters[0]  # the middle block: its holes on both sides merge with it
    assert arena.stats()["free_blocks"] == 1
    assert arena.allocate([512], torch.float32).data_ptr() == arena.data_ptr()


def test_zero_byte_requests_take_no_block(impl: str) -> None:
    arena = make(impl, 64)
    full = arena.allocate([64], torch.uint8)
    empties = [arena.allocate(shape, torch.float32) for shape in ([0], [3, 0], [0, 0, 7])]
    assert [tuple(t.shape) for t in empties] == [(0,), (3, 0), (0, 0, 7)]
    assert arena.stats()["allocations"] == 1 and full.numel() == 64


def test_invalid_arguments_are_value_errors(impl: str) -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be positive, got 0; set " + KEY):
        make(impl, 0)
    with pytest.raises(ValueError, match="negative size"):
        make(impl, 1024).allocate([4, -1], torch.float32)


# ------------------------------------------------------------------------------ lifetime and threads
def test_tensors_outlive_the_arena(impl: str) -> None:
    arena = make(impl, 16 << 20)
    whole = arena.allocate([1 << 20], torch.float32).fill_(1.5)
    view = arena.allocate([1000], torch.int64)[10:20].fill_(7)  # only a view of the block is kept
    del arena
    gc.collect()
    churn = [torch.full([1 << 20], 9.0) for _ in range(8)]  # would land in the buffer's memory if it were freed
    assert whole.eq(1.5).all() and view.eq(7).all() and all(c.eq(9.0).all() for c in churn)
    whole.add_(1)
    del whole, view  # the blocks go back to a state only they kept alive


def test_frees_from_other_threads(impl: str) -> None:
    arena = make(impl, 1 << 20)
    handed: list[torch.Tensor] = [arena.allocate([256], torch.float32) for _ in range(64)]
    assert arena.stats()["allocations"] == 64

    def drop(tensors: list[torch.Tensor]) -> None:
        while tensors:
            tensors.pop().set_()  # releases the GIL: the deleter runs inside the op on this thread

    threads = [threading.Thread(target=drop, args=(handed[i::2],)) for i in range(2)]
    handed.clear()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_coalesced(arena.stats(), 1 << 20)


def test_threads_allocating_and_freeing_together(impl: str) -> None:
    arena = make(impl, 8 << 20)  # far more than 4 threads hold, so no refusals
    failures: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held: list[torch.Tensor] = []
        try:
            for _ in range(300):
                if held and rng.random() < 0.5:
                    held.pop(rng.randrange(len(held))).set_()  # freed with the GIL released
                else:
                    held.append(arena.allocate([rng.randint(1, 4096)], torch.int32).fill_(seed))
                if any(not t.eq(seed).all() for t in held):
                    failures.append(f"thread {seed}: a block was overwritten by another thread")
                    return
        except RuntimeError as error:  # a thread's exception would otherwise only be printed
            failures.append(f"thread {seed}: {error!r}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert_coalesced(arena.stats(), 8 << 20)
