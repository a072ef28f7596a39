"""Process groups for tensor x data parallelism, with the accessors Megatron's `mpu` has.

Ranks are laid out as Megatron lays them: the `tp` ranks of one tensor-parallel group are consecutive
(they exchange activations every layer, so they should share a node), and a data-parallel group
takes one rank from each tensor-parallel group:

    world 4, tp 2:   tensor-parallel groups [0, 1] [2, 3]     data-parallel groups [0, 2] [1, 3]

ZeRO partitions over the data-parallel group only (paper sections 2 and 8): tensor parallelism
already splits each layer, and every rank of a data-parallel group holds the same slices.

    groups = engine.parallel.initialize_model_parallel(tensor_model_parallel_size=2)
    engine.parallel.get_data_parallel_world_size()   # 2 at world 4

The module-level functions are the interface DeepSpeed reads from a Megatron `mpu` (the module
itself can be passed as `mpu=`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import comm
from engine.comm import ProcessGroup
from engine.config.errors import ConfigError


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's tensor- and data-parallel groups."""

    tp_size: int
    dp_size: int
    tp_group: ProcessGroup | None
    """None when tp_size is 1 (nothing to exchange)."""
    dp_group: ProcessGroup | None
    """None when it is the whole world (tp_size 1): the default group serves."""
    tp_rank: int
    dp_rank: int
    tp_ranks: tuple[int, ...]
    """Global ranks of this rank's tensor-parallel group, in group order."""
    dp_ranks: tuple[int, ...]
    """Global ranks of this rank's data-parallel group, in group order."""
    generation: int
    """comm.generation() when made: the groups die with the default group."""
    sp_size: int = 1
    """Ranks that split each sample's tokens (engine/parallel/sequence_groups.py). ZeRO's data-parallel
    group above spans them: it partitions and averages over every rank; a sample has dp_size // sp_size
    replicas for batch arithmetic."""
    sp_group: ProcessGroup | None = None
    sp_rank: int = 0

    @classmethod
    def data_parallel_only(cls) -> ParallelGroups:
        """No tensor parallelism: the whole world is the data-parallel group."""
        world, rank = comm.get_world_size(), comm.get_rank()
        return cls(
            tp_size=1,
            dp_size=world,
            tp_group=None,
            dp_group=None,
            tp_rank=0,
            dp_rank=rank,
            tp_ranks=(rank,),
            dp_ranks=tuple(range(world)),
            generation=comm.generation(),
        )

    def dp_src(self, position: int = 0) -> int:
        """Global rank of the data-parallel group's member at `position` (collectives take global src)."""
        return self.dp_ranks[position]

    def counts_replicated(self) -> bool:
        """Whether this rank counts parameters replicated across its tensor-parallel group (norms, a
        row-parallel layer's bias) in sums over the world: only tensor-parallel rank 0 does, so each
        counts once."""
        return self.tp_rank == 0


_groups: ParallelGroups | None = None


def layout(world_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, data-parallel groups) as lists of global ranks (pure arithmetic)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tensor_model_parallel_size={tp_size!r} must be an int >= 1")
    if world_size % tp_size:
        raise ConfigError(
            f"tensor_model_parallel_size {tp_size} does not divide the world size {world_size}; "
            f"use a divisor of {world_size} "
            f"({', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})"
        )
    tp_groups = [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]
    dp_groups = [list(range(offset, world_size, tp_size)) for offset in range(tp_size)]
    return tp_groups, dp_groups


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> ParallelGroups:
    """Make the groups on every rank (every rank must call it, with the same size). Calling it again
    with the same size returns the groups already made; another size is refused until
    destroy_model_parallel()."""
    global _groups
    world, rank = comm.get_world_size(), comm.get_rank()
    tp_groups, dp_groups = layout(world, tensor_model_parallel_size)
    _forget_dead_groups()
    if _groups is not None:
        if _groups.tp_size == tensor_model_parallel_size:
            return _groups
        raise ConfigError(
            f"model parallelism is already initialised with tensor_model_parallel_size "
            f"{_groups.tp_size}; call engine.parallel.destroy_model_parallel() before asking for "
            f"{tensor_model_parallel_size}"
        )
    tp = tensor_model_parallel_size
    # Every rank makes every group in the same order, also those it is not in (torch's rule).
    made_tp = [comm.new_group(ranks, "tp") for ranks in tp_groups] if tp > 1 else [None] * len(tp_groups)
    made_dp = [comm.new_group(ranks, "dp") for ranks in dp_groups] if tp > 1 else [None]
    tp_index, dp_index = rank // tp, rank % tp
    _groups = ParallelGroups(
        tp_size=tp,
        dp_size=world // tp,
        tp_group=made_tp[tp_index],
        dp_group=made_dp[dp_index],
        tp_rank=rank % tp,
        dp_rank=rank // tp,
        tp_ranks=tuple(tp_groups[tp_index]),
        dp_ranks=tuple(dp_groups[dp_index]),
        generation=comm.generation(),
    )
    return _groups


def _forget_dead_groups() -> None:
    global _groups
    if _groups is not None and _groups.generation != comm.generation():
        _groups = None


def model_parallel_is_initialized() -> bool:
    _forget_dead_groups()
    return _groups is not None


def destroy_model_parallel() -> None:
    """Forget the groups (the process group they belong to is the caller's to destroy)."""
    global _groups
    _groups = None


def groups() -> ParallelGroups:
    _forget_dead_groups()
    if _groups is None:
        raise RuntimeError(
            "model parallelism is not initialised: call "
            "engine.parallel.initialize_model_parallel(tensor_model_parallel_size) on every rank first"
        )
    return _groups


# Megatron's mpu interface (what DeepSpeed's engine reads from `mpu=`).
def get_tensor_model_parallel_group() -> ProcessGroup | None:
    return groups().tp_group


def get_tensor_model_parallel_world_size() -> int:
    return groups().tp_size


def get_tensor_model_parallel_rank() -> int:
    return groups().tp_rank


def get_data_parallel_group() -> ProcessGroup | None:
    return groups().dp_group


def get_data_parallel_world_size() -> int:
    return groups().dp_size


def get_data_parallel_rank() -> int:
    return groups().dp_rank


# The older names (model parallel = tensor parallel here: no pipeline stages).
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
