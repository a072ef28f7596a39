"""Run a test function on N real processes over gloo (the helper every distributed test uses).

    results = run_distributed(my_check, world_size=2, args=(...))   # one result per rank

`fn` must be a module-level function (it is pickled into spawned processes). Each rank gets
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT),
one intra-op thread, and the default process group is destroyed in `finally`. A rank that raises
fails the test with its traceback, rank-prefixed; a rank that does not finish in `timeout`
seconds fails it too (the others are killed), so a hang can never stall the suite.

Ranks are forked from a forkserver that has imported torch and the engine once (importing them costs
each spawned process 2-3 s of CPU: most of a small distributed test, and minutes of the suite). The
forkserver's own environment is the one it started with, so each rank is given the parent's environment as it is
at the call, as a spawned process would inherit it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once in the forkserver; each rank forks from it with these already loaded. torch._dynamo:
# torch.optim.Optimizer.__init__ imports it on first use (torch._disable_dynamo), 2.8 s of CPU per
# process here, paid by every rank of every test that builds an optimizer. engine: 0.27 s of CPU per
# rank to import, 600-odd ranks in the suite (measured on 2 cores: 8 test files, 106 tests, 200 s ->
# 123 s). Importing it starts no thread and reads no environment (the engine reads its variables when
# called), so a rank forked with it loaded behaves as one that imports it. transformers' Llama (and with it
# modeling_utils, which every transformers model imports): 1.2 s per rank for the ranks that build a Hugging
# Face model (tests/test_sequence_parallel.py, test_hf_surfaces.py, test_config_real_configs.py: 38 s -> 24 s).
# A missing module is skipped by the forkserver.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "engine", "transformers.models.llama.modeling_llama"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: mp.Queue[tuple[int, bool, Any]],
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: torch's queue reducers would pass tensors through shared memory that
        # disappears when this process exits before the parent reads it.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report every failure, including SystemExit, to the parent
        results.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run fn(*args) on `world_size` processes; return the per-rank results, rank order."""
    ctx = _context()
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, port, args, {**os.environ, **(env or {})}, results), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                    f"(hang?); finished: {sorted(outcome)}"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})"
                    )
                continue
            outcome[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:
                # One failed rank may leave the others blocked in a collective: stop now.
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcome) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [outcome[r][1] for r in range(world_size)]
