"""Process groups and collectives: the only package in engine/ that calls torch.distributed.

Everything else goes through these functions (`from engine import comm; comm.all_gather(...)`) so that
(a) every byte sent is counted for `comm_stats()`, (b) the engine's own gloo collectives replace
torch's in one place, and (c) a test can forbid direct torch.distributed use elsewhere
(tests/test_layering.py). By job:

- lifecycle.py: the default group (init_distributed, rank and world size, teardown);
- groups.py: named subgroups (tensor x data parallel), whose traffic is counted by name;
- collectives.py: all-reduce, reduce-scatter, all-gather, broadcast, ..., and the byte counts;
  p2p.py (direct exchanges) and ring.py (rings) are its gloo schedules, transport.py their sends;
- link.py: the group's latency and bandwidth, measured once (the bucket sizes come from it);
- state.py: what the process keeps between calls, reset when the default group ends.
"""

from torch.distributed import ProcessGroup

from engine.comm.collectives import (
    COLLECTIVES,
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
    free_buffers,
    reduce_scatter,
    set_collectives,
    wait,
)
from engine.comm.groups import adopt_group, generation, group_rank, group_ranks, group_size, new_group
from engine.comm.lifecycle import (
    acquire_process_group,
    default_backend,
    destroy_process_group,
    get_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    release_process_group,
    world_size_source,
)
from engine.comm.link import LinkSpeed, measure_link

__all__ = [
    "COLLECTIVES",
    "Handle",
    "LinkSpeed",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "acquire_process_group",
    "adopt_group",
    "all_gather",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "collective_timeout",
    "collectives_impl",
    "comm_stats",
    "default_backend",
    "destroy_process_group",
    "free_buffers",
    "generation",
    "get_backend",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "group_rank",
    "group_ranks",
    "group_size",
    "init_distributed",
    "is_initialized",
    "measure_link",
    "new_group",
    "reduce_scatter",
    "release_process_group",
    "set_collectives",
    "wait",
    "world_size_source",
]
