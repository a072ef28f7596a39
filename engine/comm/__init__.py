"""Process groups and collectives: the only package in engine/ that calls torch.distributed.

Everything else goes through these functions (`from engine import comm; comm.all_gather(...)`) so that
(a) every byte sent is counted for `comm_stats()`, (b) the engine's own gloo collectives replace
torch's in one place, and (c) a test can forbid direct torch.distributed use elsewhere
(tests/test_layering.py). By job:

- lifecycle.py: the default group (init_distributed, rank and world size, teardown);
- groups.py: named subgroups (tensor x data parallel), whose traffic is counted by name;
- collectives.py: all-reduce, reduce-scatter, all-gather, broadcast, ..., and the byte counts;
  p2p.py (direct exchanges) and ring.py (rings) are its gloo schedules, transport.py their sends;
- torch_style.py: the collectives in torch.distributed's (and deepspeed.comm's) signatures, for user
  code: lists of tensors, all-to-all, reduce, gather, scatter, objects. Its list-form all_gather,
  reduce_scatter and all_gather_object stay in that module (here those names are the engine's flat ones);
- sendrecv.py: a user's send and recv; comms_log.py: DeepSpeed's comms-logger calls over comm_stats();
- link.py: the group's latency and bandwidth, measured once (the bucket sizes come from it);
- state.py: what the process keeps between calls, reset when the default group ends.
"""

from torch.distributed import ProcessGroup

from engine.comm.collectives import (
    COLLECTIVES,
    Finish,
    Handle,
    ReduceOp,
    Work,
    all_gather,
    all_gather_list,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_coalesced,
    collective_timeout,
    collectives_impl,
    comm_stats,
    count_sent,
    free_buffers,
    reduce_scatter,
    set_collectives,
    wait,
)
from engine.comm.comms_log import (
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)
from engine.comm.groups import (
    adopt_group,
    generation,
    get_global_rank,
    get_world_group,
    group_rank,
    group_ranks,
    group_size,
    is_world,
    new_group,
)
from engine.comm.lifecycle import (
    acquire_process_group,
    default_backend,
    destroy_process_group,
    get_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    release_process_group,
    world_size_source,
)
from engine.comm.link import LinkSpeed, measure_link
from engine.comm.sendrecv import irecv, isend, recv, send
from engine.comm.torch_style import (
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    allgather_fn,
    broadcast_object_list,
    gather,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    monitored_barrier,
    reduce,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    scatter,
)

__all__ = [
    "COLLECTIVES",
    "Finish",
    "Handle",
    "LinkSpeed",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "acquire_process_group",
    "adopt_group",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "broadcast_object_list",
    "collective_timeout",
    "collectives_impl",
    "comm_stats",
    "configure",
    "count_sent",
    "default_backend",
    "destroy_process_group",
    "free_buffers",
    "gather",
    "generation",
    "get_backend",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "group_rank",
    "group_ranks",
    "group_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "is_world",
    "isend",
    "log_summary",
    "measure_link",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "release_process_group",
    "reset_log",
    "scatter",
    "send",
    "set_collectives",
    "wait",
    "world_size_source",
]
