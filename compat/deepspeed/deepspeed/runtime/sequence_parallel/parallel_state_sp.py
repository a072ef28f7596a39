"""`deepspeed.runtime.sequence_parallel.parallel_state_sp` -> engine.parallel.sequence_groups."""

from engine.parallel.sequence_groups import (
    destroy_sequence_parallel,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
)

__all__ = [
    "destroy_sequence_parallel",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]
