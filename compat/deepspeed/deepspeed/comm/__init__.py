"""`deepspeed.comm` -> engine.comm."""

from engine.comm import (
    ReduceOp,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)

__all__ = [
    "ReduceOp",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_backend",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]
