"""Tensor x data parallelism: process groups with Megatron's mpu interface (groups.py), Megatron's
tensor-parallel layers (layers.py) and AutoTP, which shards an ordinary model with them (autotp.py);
sequence-parallel groups (sequence_groups.py, DeepSpeed's parallel_state_sp interface).

The package itself can be passed as `mpu=` wherever a Megatron mpu module is accepted.
"""

from engine.parallel.autotp import plan_autotp, tp_model_init
from engine.parallel.cross_entropy import vocab_parallel_cross_entropy
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
from engine.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
)
from engine.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from engine.parallel.random import (
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from engine.parallel.sequence_groups import (
    SequenceGroups,
    destroy_sequence_parallel,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
    sequence_parallel_is_initialized,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelGroups",
    "RNGStatesTracker",
    "RowParallelLinear",
    "SequenceGroups",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "destroy_model_parallel",
    "destroy_sequence_parallel",
    "gather_from_tensor_parallel_region",
    "get_cuda_rng_tracker",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_rng_tracker",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "groups",
    "initialize_model_parallel",
    "initialize_sequence_parallel",
    "layout",
    "model_parallel_cuda_manual_seed",
    "model_parallel_is_initialized",
    "model_parallel_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "plan_autotp",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "sequence_parallel_is_initialized",
    "set_tensor_model_parallel_attributes",
    "tp_model_init",
    "vocab_parallel_cross_entropy",
]
