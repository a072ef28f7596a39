"""A user's Megatron-style `mpu` object (what `deepspeed.initialize(mpu=...)` takes) read into this
engine's ParallelGroups, with a named error for anything that cannot work.

An mpu must answer the data-parallel and the tensor-parallel questions: get_data_parallel_group /
world_size / rank, and get_tensor_model_parallel_group / world_size / rank (or Megatron's older
get_model_parallel_* names). engine.parallel itself is such an mpu.
"""

from __future__ import annotations

from typing import Any

from engine import comm
from engine.config.errors import ConfigError
from engine.parallel.groups import ParallelGroups

_DATA = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")
_TENSOR = ("get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank")
_OLD_TENSOR = ("get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank")


def groups_from_mpu(mpu: Any) -> ParallelGroups:
    """The groups `mpu` describes, checked against the world: every method present, TP x DP sizes equal
    to the world size, and this rank's position in each group consistent with the group itself."""
    name = getattr(mpu, "__name__", type(mpu).__name__)
    tensor = _TENSOR if all(callable(getattr(mpu, m, None)) for m in _TENSOR) else _OLD_TENSOR
    missing = [m for m in (*_DATA, *tensor) if not callable(getattr(mpu, m, None))]
    if missing:
        raise ConfigError(
            f"mpu={name} lacks {', '.join(missing)}: a Megatron-style mpu needs "
            f"{', '.join(_DATA)} and {', '.join(_TENSOR)} (or the older get_model_parallel_* names); "
            "engine.parallel is one (engine.parallel.initialize_model_parallel(tp))"
        )
    dp_group, dp_size, dp_rank = (getattr(mpu, m)() for m in _DATA)
    tp_group, tp_size, tp_rank = (getattr(mpu, m)() for m in tensor)
    for group, label in ((dp_group, "dp"), (tp_group, "tp")):
        if group is not None:
            comm.adopt_group(group, label)  # counted as DP / TP traffic, usable by every collective
    world = comm.get_world_size()
    if tp_size * dp_size != world:
        raise ConfigError(
            f"mpu={name} says tensor-parallel size {tp_size} x data-parallel size {dp_size} = "
            f"{tp_size * dp_size} ranks, but the world has {world} (pipeline parallelism is not "
            "supported: tensor x data must cover every rank)"
        )
    # A None tensor-parallel group means no tensor parallelism (size 1); a None data-parallel group
    # means the world (engine.parallel's convention at TP 1).
    tp_ranks = [comm.get_rank()] if tp_group is None else comm.group_ranks(tp_group)
    dp_ranks = comm.group_ranks(dp_group)
    for what, ranks, size, rank in (("data", dp_ranks, dp_size, dp_rank), ("tensor_model", tp_ranks, tp_size, tp_rank)):
        if len(ranks) != size or comm.get_rank() not in ranks or ranks.index(comm.get_rank()) != rank:
            at = ranks.index(comm.get_rank()) if comm.get_rank() in ranks else "absent"
            raise ConfigError(
                f"mpu={name}: get_{what}_parallel_world_size/rank() say {size}/{rank} but its group "
                f"has {len(ranks)} ranks {ranks} with this one (global rank {comm.get_rank()}) at {at}"
            )
    return ParallelGroups(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_group=tp_group,
        dp_group=dp_group,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        tp_ranks=tuple(tp_ranks),
        dp_ranks=tuple(dp_ranks),
        generation=comm.generation(),
    )
