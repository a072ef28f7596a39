"""Random streams for tensor parallelism: Megatron's CudaRNGStatesTracker, for the CPU generator too.

Dropout must agree across the ranks of a tensor-parallel group where they hold the same activation
(outside the parallel regions: the residual stream) and must differ where each rank holds its own
slice (inside them: attention heads, the MLP's hidden columns), or the slices would share one mask
pattern. So there are two streams:

    model_parallel_manual_seed(1234)      # default generator: 1234 on every rank
    x = F.dropout(x, 0.1)                 # same mask on every TP rank
    with get_rng_tracker().fork():        # "model-parallel-rng": 1234 + 2718 + tp_rank
        h = F.dropout(h_shard, 0.1)       # a different mask on each TP rank

fork() swaps the named stream's state into torch's default generators (the CPU one, and the
current CUDA device's when CUDA is initialised), runs the block, saves the advanced state back and
restores the default generators, so code outside the block draws as if the block never ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.parallel.groups import get_tensor_model_parallel_rank, model_parallel_is_initialized

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker's stream for randomness inside tensor-parallel regions (Megatron's name)."""

_MODEL_PARALLEL_SEED_OFFSET = 2718
"""Megatron's offset between the default seed and the model-parallel stream's (before + tp_rank)."""


@dataclass(frozen=True)
class RNGState:
    """One stream's generator states."""

    cpu: torch.Tensor
    """torch.get_rng_state()'s form (uint8)."""
    cuda: torch.Tensor | None
    """The current CUDA device's state; None when CUDA was not initialised when it was taken."""


def _cuda_tracked() -> bool:
    # Only once CUDA is initialised: reading a state would otherwise start a CUDA context on a
    # CPU-only run that merely has a GPU in the machine.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _current_state() -> RNGState:
    return RNGState(torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda_tracked() else None)


def _install(state: RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and _cuda_tracked():
        torch.cuda.set_rng_state(state.cuda)


def _seeded_state(seed: int) -> RNGState:
    """The state a fresh seeding with `seed` gives, without touching the default generators."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if _cuda_tracked():
        before = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        cuda = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(before)
    return RNGState(cpu, cuda)


class RNGStatesTracker:
    """Named random streams, each swapped into torch's default generators by fork(name)."""

    def __init__(self) -> None:
        self._states: dict[str, RNGState] = {}
        self._seeds: set[int] = set()  # two streams from one seed would draw the same numbers

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every stream's state (for checkpoints, or to replay a region)."""
        return dict(self._states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        """Replace the streams by `states` (from get_states())."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by a stream; give {name!r} another seed")
        if name in self._states:
            raise ValueError(f"RNG tracker: a stream named {name!r} already exists (reset() first to reseed it)")
        self._seeds.add(seed)
        self._states[name] = _seeded_state(seed)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default generators are untouched after it."""
        if name not in self._states:
            raise KeyError(
                f"RNG tracker has no stream {name!r} (known: {sorted(self._states)}); call "
                "engine.parallel.model_parallel_manual_seed(seed) or get_rng_tracker().add(name, seed)"
            )
        outside = _current_state()
        _install(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _current_state()
            _install(outside)


_TRACKER = RNGStatesTracker()


@dataclass(frozen=True)
class AllRNGStates:
    """Every random stream a forward can draw from: torch's default generators and the tracker's."""

    default: RNGState
    tracker: dict[str, RNGState]


def get_all_states() -> AllRNGStates:
    """Everything a forward's randomness depends on (activation checkpointing replays it)."""
    return AllRNGStates(_current_state(), _TRACKER.get_states())


def set_all_states(states: AllRNGStates) -> None:
    _install(states.default)
    _TRACKER.set_states(states.tracker)


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Megatron and DeepSpeed: get_cuda_rng_tracker)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generators with `seed` on every rank (replicated activations' dropout matches
    across the tensor-parallel group) and the tracker's "model-parallel-rng" stream with
    seed + 2718 + tp_rank (dropout inside parallel regions differs across it). The tensor-parallel
    rank is 0 when model parallelism is not initialised. Megatron: model_parallel_cuda_manual_seed."""
    tp_rank = get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


# DeepSpeed's and Megatron's names.
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed
CudaRNGStatesTracker = RNGStatesTracker
