"""The process's default group: created from the launch environment, queried, and torn down.

init_distributed (DeepSpeed's), the rank and world-size queries every module uses, and the group an
engine creates implicitly (acquire/release_process_group). Ending the default group ends what the
other modules of engine/comm/ kept about it, so destroy_process_group() resets their state too.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.accelerator import get_accelerator
from engine.comm import ring
from engine.comm.state import STATE

logger = logging.getLogger("engine")

# Environment variables a launcher (zrun, torchrun, deepspeed) sets for each rank.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _mpi_env_to_torch_env() -> None:
    """Map Open MPI / MPICH rank variables to torchrun's names (mpirun without mpi4py)."""
    pairs = (
        ("OMPI_COMM_WORLD_RANK", "RANK"),
        ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
        ("PMI_RANK", "RANK"),
        ("PMI_SIZE", "WORLD_SIZE"),
    )
    for mpi_name, torch_name in pairs:
        if mpi_name in os.environ and torch_name not in os.environ:
            os.environ[torch_name] = os.environ[mpi_name]


def default_backend() -> str:
    # The device decision (DS_ACCELERATOR, else CUDA when available) lives in engine/accelerator.py.
    return get_accelerator().communication_backend_name()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: timedelta = timedelta(minutes=30),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group, DeepSpeed-style.

    Reuses an existing group. Otherwise reads torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), or Open MPI's when launched by mpirun. Without any launcher it
    creates a one-process group on an in-memory store, so world size 1 runs the same code path
    as N ranks and no port is opened.
    """
    if dist.is_initialized():
        STATE.world_size_source = (
            STATE.world_size_source
            if STATE.owns_group
            else ("the process group that already existed when the engine started")
        )
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but no torch.distributed process group exists; "
            "call torch.distributed.init_process_group() first or drop dist_init_required"
        )
    if auto_mpi_discovery:
        _mpi_env_to_torch_env()
    backend = dist_backend or default_backend()
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE"))
    if rank >= 0 and world_size > 0:
        dist.init_process_group(
            backend, init_method=init_method or "env://", rank=rank, world_size=world_size, timeout=timeout
        )
        STATE.world_size_source = "the rank/world_size arguments of init_distributed()"
    elif launched:
        missing = [n for n in _LAUNCH_ENV if n not in os.environ]
        if missing and init_method is None:
            raise RuntimeError(
                f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; start the job with "
                "zrun (or torchrun), or export MASTER_ADDR and MASTER_PORT"
            )
        if init_method is None:
            _init_from_env(backend, timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, timeout=timeout)
        STATE.world_size_source = f"WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment (launcher)"
    else:
        # A plain `python train.py`: one rank on an in-process store, nothing listens.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        STATE.world_size_source = "no launcher environment (RANK/WORLD_SIZE unset): a single process"
    STATE.owns_group = True
    _register_teardown()
    if verbose and get_rank() == 0:
        logger.info(
            "initialised %s process group: world size %d (%s)", backend, get_world_size(), STATE.world_size_source
        )


def _teardown_at_exit() -> None:
    """Destroy the default process group while the interpreter is whole, whoever made it.

    Left to interpreter shutdown, a gloo worker thread can still be releasing the last collective's
    work object (HF's gather_for_metrics all-gather) when Python finalizes; it needs the GIL to drop
    the tensors' Python objects, gets pthread_exit instead, and the rank aborts after its work is done
    ("terminate called without an active exception", exit 134: 1 run in 5 of Trainer's ZeRO-3
    evaluation at 2 ranks; 0 in 15 with the group destroyed first). Nothing can use a group after
    the interpreter starts exiting, so destroying one the application made is safe here. A group
    destroyed earlier (engine.destroy()) can still be alive through a reference cycle and hit the same
    abort at shutdown (tests/zrun_scripts/train_losses.py at 4 ranks: 3 runs in 25), so a garbage
    collection here frees it while Python can still run its threads' releases (0 in 35 after)."""
    if dist.is_initialized():
        if STATE.owns_group:
            destroy_process_group()
        else:
            dist.destroy_process_group()
    STATE.store = None
    gc.collect()  # a destroyed group that something still references goes now, not during shutdown


def _register_teardown() -> None:
    atexit.unregister(_teardown_at_exit)  # once, however many groups or engines the process makes
    atexit.register(_teardown_at_exit)


def _init_from_env(backend: str, timeout: timedelta) -> None:
    """init_process_group from the launcher's environment, on a store kept for the process's life.

    # [Note: one rendezvous store per process]
    # torch's env:// rendezvous is not repeatable across ranks: each new group writes its keys
    # (gloo's addresses, barriers) under the same names in the same store (zrun's and torchrun's
    # agent store outlives the group), so a rank that destroyed its group and created the next one
    # before a slower peer destroyed its own read that peer's *old* addresses and failed or hung
    # (a retried initialize, a destroy/initialize loop at 2 ranks: half the runs). Here the store is
    # made once per launch environment and each group gets its own key prefix, numbered the same on
    # every rank (every rank creates and destroys groups in the same order), so a group's keys are
    # only ever read by members of that same group.
    """
    key = tuple(os.environ.get(n, "") for n in (*_LAUNCH_ENV, "TORCHELASTIC_RUN_ID"))
    if STATE.store is None or STATE.store_key != key:
        STATE.store, STATE.store_key = next(dist.rendezvous("env://", timeout=timeout))[0], key
        STATE.groups_made = 0
    STATE.groups_made += 1
    store = dist.PrefixStore(f"zero_engine/group{STATE.groups_made}/", STATE.store)
    dist.init_process_group(
        backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
    )


def world_size_source() -> str:
    return STATE.world_size_source


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    """Whether this torch was built with the distributed package."""
    return dist.is_available()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's global rank (0 before any group exists), or with `group` its position in that
    group (-1 when it is not a member: torch's answer)."""
    if group is not None:
        return dist.get_rank(group)
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in the default group (1 before any group exists), or in `group` (-1 when this process is
    not a member)."""
    if group is not None:
        return dist.get_world_size(group)
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_backend(group: ProcessGroup | None = None) -> str:
    return dist.get_backend(group)


def acquire_process_group(distributed_port: int | None = None, dist_init_required: bool | None = None) -> bool:
    """For engine.initialize(): make sure a group exists. Returns True when the engine must call
    release_process_group() on destroy (the group was created implicitly, for engines only)."""
    if not dist.is_initialized():
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
        STATE.implicit_group = True
    _register_teardown()
    if STATE.implicit_group:
        STATE.engine_refs += 1
    return STATE.implicit_group


def release_process_group() -> None:
    STATE.engine_refs -= 1
    if STATE.engine_refs <= 0 and STATE.implicit_group:
        STATE.implicit_group = False
        STATE.engine_refs = 0
        destroy_process_group()


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Tear down the default group, but only if init_distributed created it; or, given one, the
    subgroup `group` (DeepSpeed's and torch's argument), forgetting what was kept about it."""
    if group is not None and group is not dist.GroupMember.WORLD:
        STATE.subgroups.pop(group, None)
        STATE.group_seq.pop(group, None)
        if isinstance(group, ProcessGroup):  # a rank outside the group holds torch's non-member mark
            dist.destroy_process_group(group)
        return
    if STATE.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    STATE.link, STATE.p2p_seq = None, 0  # a new group is measured and counted afresh
    STATE.subgroups.clear()  # subgroups end with the default group
    STATE.group_seq.clear()
    STATE.generation += 1
    ring.PROGRESS.reset()
    STATE.owns_group = False
    STATE.world_size_source = "not initialised"
