"""`deepspeed.utils.groups` -> the engine's process groups: the sequence-parallel ones Accelerate and the
Trainer read (engine.parallel.sequence_groups), and data/model parallel ones (engine.parallel)."""

from engine import comm
from engine.comm import ProcessGroup
from engine.parallel import groups as _tp
from engine.parallel import sequence_groups as _sp


def _get_sequence_parallel_group() -> ProcessGroup:
    return _sp.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return _sp.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return _sp.get_sequence_parallel_rank()


def _get_sequence_data_parallel_group() -> ProcessGroup:
    return _sp.get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _sp.get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _sp.get_sequence_data_parallel_rank()


def _get_data_parallel_world_size() -> int:
    """Ranks holding different samples: the world over tensor and sequence parallelism."""
    tp = _tp.groups().tp_size if _tp.model_parallel_is_initialized() else 1
    return comm.get_world_size() // tp // _sp.get_sequence_parallel_world_size()


def _get_model_parallel_world_size() -> int:
    return _tp.groups().tp_size if _tp.model_parallel_is_initialized() else 1
