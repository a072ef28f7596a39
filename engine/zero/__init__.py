"""ZeRO: the stages and the user API DeepSpeed code calls (`engine.zero.Init`,
`engine.zero.GatheredParameters`, `engine.zero.set_z3_leaf_modules`).

- flat/: stages 0-2, whose parameters live whole on every rank in flat, bucketed buffers
  (Stage0, Stage1, Stage2, and ForwardOnly for an engine without an optimizer);
- stage3/: stage 3, whose parameters are partitioned between the forwards and backwards that use
  them (Stage3 and its gather units, prefetching, gradients and memory);
- here, what both use: the stage interface (base.py), the flat layout math (layout.py), flat groups
  and the optimizer step on fp32 masters (flat_groups.py, master_step.py, shard_step.py,
  shard_reduce.py), the gradient-norm scope over tensor x data parallelism (norm_scope.py), bucket
  buffers and launch order (bucket_pool.py, ordered_launch.py), tensor-parallel state dicts
  (tp_state.py), what a stage holds for a checkpoint (records.py, clone.py), which stage owns a
  parameter (owners.py), stage-3 leaf modules (leaf_modules.py), DeepSpeed's tensor-fragment functions reading and writing a
  parameter's fp32 value, gradient and optimizer state (tensor_fragment.py over fragments.py), the checked moves of every state machine (state_moves.py), and the parameters built partitioned by `engine.zero.Init`
  (partitioned_init.py, released.py; a parameter nothing wrote is refused, unwritten.py) or gathered by `GatheredParameters` (gathered.py) at any stage.
"""

from engine.zero.gathered import GatheredParameters
from engine.zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from engine.zero.partitioned_init import Init
from engine.zero.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from engine.zero.unwritten import UnwrittenParameterError

__all__ = [
    "GatheredParameters",
    "Init",
    "UnwrittenParameterError",
    "get_z3_leaf_modules",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
