"""Sequence-parallel groups (DeepSpeed-Ulysses, ALST): the ranks that split one sample's tokens.

The world is laid out as a (data, sequence) grid, the sequence dimension innermost: the `sp` ranks of
one sequence-parallel group are consecutive (they exchange activations twice per attention layer, so
they should share a node), as DeepSpeed and a DeviceMesh of shape (world // sp, sp) lay them out:

    world 4, sp 2:   sequence-parallel groups [0, 1] [2, 3]     data-parallel replicas: 2

ZeRO partitions and averages over every rank (the sequence-data-parallel group, the whole world
here): the ranks of a sequence-parallel group hold different tokens of the same samples, and the
losses clients compute under sequence parallelism (Hugging Face's all-gathered, token-weighted loss,
whose backward sums over the group) make the average over all ranks the true gradient. Batch
arithmetic counts world // sp data-parallel replicas.

    engine.parallel.initialize_sequence_parallel(2)
    engine.parallel.get_sequence_parallel_world_size()   # 2

The module-level functions are DeepSpeed's `parallel_state_sp` interface (the mpu that
UlyssesSPAttentionHF.register_with_transformers returns, which the module itself serves as) and what
`deepspeed.utils.groups._get_sequence_parallel_*` answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import comm
from engine.comm import ProcessGroup
from engine.config.errors import ConfigError


@dataclass(frozen=True)
class SequenceGroups:
    size: int
    group: ProcessGroup
    """This rank's sequence-parallel group."""
    rank: int
    """Position in it: which slice of each sample's tokens this rank holds."""
    ranks: tuple[int, ...]
    generation: int
    """comm.generation() when made: the groups die with the default group."""


_groups: SequenceGroups | None = None


def sequence_layout(world_size: int, sp_size: int) -> list[list[int]]:
    """The sequence-parallel groups as lists of global ranks (pure arithmetic), or a ConfigError naming the fix."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ConfigError(f"sequence_parallel_size={sp_size!r} must be an int >= 1")
    if world_size % sp_size:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"sequence_parallel_size {sp_size} does not divide the world size {world_size}: every sample's "
            f"tokens are split over sp ranks and the world holds whole groups of them; use one of {divisors}"
        )
    return [list(range(start, start + sp_size)) for start in range(0, world_size, sp_size)]


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceGroups:
    """Make the sequence-parallel groups on every rank (every rank calls it with the same size). Asked
    again for the same size, the groups already made; another size is refused until
    destroy_sequence_parallel()."""
    global _groups
    _forget_dead_groups()
    if _groups is not None:
        if _groups.size == sequence_parallel_size:
            return _groups
        raise ConfigError(
            f"sequence parallelism is already initialised with size {_groups.size}; call "
            f"engine.parallel.destroy_sequence_parallel() before asking for {sequence_parallel_size}"
        )
    world, rank = comm.get_world_size(), comm.get_rank()
    layout = sequence_layout(world, sequence_parallel_size)
    made = [comm.new_group(ranks, "sp") for ranks in layout]  # every rank makes every group (torch's rule)
    index = rank // sequence_parallel_size
    _groups = SequenceGroups(
        size=sequence_parallel_size,
        group=made[index],
        rank=rank % sequence_parallel_size,
        ranks=tuple(layout[index]),
        generation=comm.generation(),
    )
    return _groups


def _forget_dead_groups() -> None:
    global _groups
    if _groups is not None and _groups.generation != comm.generation():
        _groups = None


def sequence_parallel_is_initialized() -> bool:
    _forget_dead_groups()
    return _groups is not None


def sequence_groups() -> SequenceGroups | None:
    """The groups made by initialize_sequence_parallel, or None (no sequence parallelism)."""
    _forget_dead_groups()
    return _groups


def destroy_sequence_parallel() -> None:
    global _groups
    _groups = None


def _required() -> SequenceGroups:
    made = sequence_groups()
    if made is None:
        raise RuntimeError(
            "sequence parallelism is not initialised: set sequence_parallel_size in the config, call "
            "engine.parallel.initialize_sequence_parallel(size) on every rank, or "
            "UlyssesSPAttentionHF.register_with_transformers(...) first"
        )
    return made


# DeepSpeed's parallel_state_sp interface.
def get_sequence_parallel_group() -> ProcessGroup:
    return _required().group


def get_sequence_parallel_world_size() -> int:
    made = sequence_groups()
    return made.size if made is not None else 1


def get_sequence_parallel_rank() -> int:
    made = sequence_groups()
    return made.rank if made is not None else 0


def get_sequence_data_parallel_group() -> ProcessGroup:
    """Every rank: ZeRO's group under sequence parallelism (sequence parallelism with tensor
    parallelism is refused)."""
    return comm.get_world_group()


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank()
