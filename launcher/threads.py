"""How many intra-op threads each rank gets, and whether that oversubscribes the cores."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    from_user: bool  # the user exported OMP_NUM_THREADS; zrun leaves it alone
    message: str  # the one line zrun prints about the choice
    warning: str | None  # set when ranks x threads > cores


def available_cores() -> int:
    # The affinity mask, not os.cpu_count(): in a container or under taskset the rest are not ours.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_threads(local_ranks: int, cores: int, env: Mapping[str, str]) -> ThreadPlan:
    user = env.get("OMP_NUM_THREADS")
    if user is not None and user.strip().isdigit() and int(user) > 0:
        threads, from_user = int(user), True
        message = f"OMP_NUM_THREADS={threads} per rank (from your environment)"
    else:
        # torchrun would force 1 with a warning; an even share keeps each rank's math parallel
        # without two ranks fighting over one core.
        threads, from_user = max(1, cores // local_ranks), False
        message = f"OMP_NUM_THREADS={threads} per rank ({cores} cores // {local_ranks} local ranks)"
    warning = None
    if local_ranks * threads > cores:
        warning = (
            f"{local_ranks} ranks x {threads} threads = {local_ranks * threads} threads on {cores} cores: "
            f"oversubscribed; CPU steps can be several times slower (a CPU Adam step measured 3-11x slower "
            f"on 2 cores). Hint: fewer ranks per node, or OMP_NUM_THREADS={max(1, cores // local_ranks)}"
        )
    return ThreadPlan(threads, from_user, message, warning)
