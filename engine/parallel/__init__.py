"""Tensor x data parallelism: process groups with Megatron's mpu interface (groups.py).

The package itself can be passed as `mpu=` wherever a Megatron mpu module is accepted.
"""

from engine.parallel.groups import (
    ParallelGroups,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    groups,
    initialize_model_parallel,
    layout,
    model_parallel_is_initialized,
)

__all__ = [
    "ParallelGroups",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "groups",
    "initialize_model_parallel",
    "layout",
    "model_parallel_is_initialized",
]
