"""The engine's collectives (engine/comm/) against torch.distributed's on gloo, real processes over loopback.

    python benchmarks/bench_comm.py [--sizes-mib 1,4,16,64,256] [--worlds 2,4] [--repeats N]

For each world size (every one in one invocation; this script spawns the ranks itself, no launcher) and
each per-rank buffer size (MiB of fp32: the full buffer each rank all-reduces; the reduce-scatter input
and the all-gather output are that same size) it times, round-robin so that drift hits all rows alike:

1. torch all_reduce (fp32): the baseline, DDP's pattern;
2. torch reduce_scatter_single and all_gather_single (reduce_scatter_tensor / all_gather_into_tensor in
   older torch), called directly, and their sum;
3. ours: engine.comm.reduce_scatter and all_gather with comm's default selection
   (ZERO_ENGINE_NATIVE_COLLECTIVES unset), and their sum;
4. ours with a bf16 wire: the reduce-scatter of a bf16 bucket into a float32 output (fp32
   accumulation, what the stages do with bf16 gradients or communication_data_type bf16) plus the
   all-gather of a bf16 buffer of the same element count, and their sum;
5. the ZeRO-3 pattern: all-gather, all-gather, reduce-scatter; ours timed as one sequence, torch's the
   sum of its parts' medians (its collectives keep no state between calls; timing the sequence too
   would add its slowest row to every round);
6. ours as rings (engine/comm/ring.py, ZERO_ENGINE_COLLECTIVES=ring): reduce-scatter and all-gather,
   fp32, and their sum: the schedule the engine offers beside its default direct exchanges.

Each time is the median over repeats, after one warm-up call, of the slowest rank's time (every rank
waits at a barrier, then times its own call; the per-repeat maximum over ranks is taken). Bus bandwidth:
all-reduce 2(N-1)/N x bytes / t, reduce-scatter and all-gather (N-1)/N x bytes / t. Ratios are taken
against the all-reduce measured in the same run. Every configuration checks ours against the exact
result computed from the ranks' deterministic inputs (the warm-up calls of the timed forms are the
check; up to 16 MiB also in place, async and torch's own results), so a broken implementation cannot
produce a good-looking table, and records engine.comm.comm_stats() bytes_sent of one call against the
(N-1)/N volume.

Writes benchmarks/results/comm.md (a table per world size, settings, machine) and comm.png (time vs
size, log-log, one panel per world size, if matplotlib is there), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import multiprocessing as mp
import os
import pickle
import queue
import re
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machine import in_repo, machine_facts

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MIB = 2**20
NATIVE_ENV = "ZERO_ENGINE_NATIVE_COLLECTIVES"
CHOICE_ENV = "ZERO_ENGINE_COLLECTIVES"
GOAL_RS_AG, GOAL_ZERO3, GOAL_BF16 = 1.2, 1.7, 0.6
FULL_CHECK_MIB = 16  # up to this size the check also covers in place, async and torch's own results


def default_repeats(mib: float) -> int:
    """Fewer repeats for big buffers: one 256 MiB round of every row takes seconds here."""
    return 10 if mib <= 4 else 7 if mib <= 16 else 5 if mib <= 64 else 3


# ---------------------------------------------------------------------------------------------- worker side
def _torch_collectives(dist: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's reduce-scatter and all-gather of flat tensors: reduce_scatter_single / all_gather_single
    where this torch has them (2.13 deprecates the *_tensor names), else the older names."""
    return (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
    )


def _slice_values(owner: int, part: int, numel: int, size_key: int) -> torch.Tensor:
    """Rank `owner`'s input values for slice `part`: deterministic, so any rank can recompute them."""
    gen = torch.Generator().manual_seed(1_000_003 * size_key + 1009 * owner + part)
    return torch.randn(numel, generator=gen)


def _fill_input(buf: torch.Tensor, rank: int, world: int, size_key: int) -> None:
    chunks = buf.view(world, -1)
    for part in range(world):
        chunks[part].copy_(_slice_values(rank, part, chunks.shape[1], size_key))


class _Expect:
    """The exact results for one (world, size), computed locally from the deterministic inputs."""

    def __init__(self, world: int, rank: int, numel: int, size_key: int) -> None:
        shard = numel // world
        parts = torch.stack([_slice_values(k, rank, shard, size_key) for k in range(world)])
        self.rs = parts.sum(0)  # this rank's slice of the sum of every rank's input
        self.abs_sum = parts.abs().sum(0)
        del parts
        self.ag = torch.cat([_slice_values(k, world, shard, size_key) for k in range(world)])
        self.ag_mine = _slice_values(rank, world, shard, size_key)
        self.world = world

    def rs_problem(self, name: str, got: torch.Tensor) -> str | None:
        if not torch.allclose(got, self.rs, rtol=1e-5, atol=1e-5):
            return f"{name}: max abs error {(got - self.rs).abs().max().item():.3g} against the exact sum"
        return None

    def rs_wire_problem(self, name: str, got: torch.Tensor) -> str | None:
        # bf16 on the wire, fp32 accumulation: each addend is rounded to bf16 at most once per hop
        # (relative error 2^-9), so (N-1) x 2^-8 x sum|x| bounds any correct pairwise or ring scheme.
        allowed = max(self.world - 1, 1) * 2.0**-8
        if got.dtype != torch.float32:
            return f"{name}: output became {got.dtype}"
        if not bool(((got - self.rs).abs() <= self.abs_sum * allowed + 1e-6).all()):
            err = ((got - self.rs).abs() / self.abs_sum.clamp_min(1e-12)).max().item()
            return f"{name}: error up to {err:.3g} x sum|x| (allowed {allowed:.3g})"
        return None

    def ag_problem(self, name: str, got: torch.Tensor) -> str | None:
        return None if torch.equal(got, self.ag.to(got.dtype)) else f"{name}: wrong result"


def _extra_checks(comm: Any, dist: Any, expect: _Expect, numel: int, size_key: int, has_wire: bool) -> list[str]:
    """The forms the timing does not use (in place, async) and torch's own results, against the exact
    result; returns this rank's problems."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = numel // world
    torch_rs, torch_ag = _torch_collectives(dist)
    src = torch.empty(numel)
    _fill_input(src, rank, world, size_key)
    out = torch.empty(shard)
    found = []
    torch_rs(out, src.clone())
    found.append(expect.rs_problem(f"torch {torch_rs.__name__}", out))
    inplace = src.clone()
    comm.reduce_scatter(inplace.view(world, -1)[rank], inplace)
    found.append(expect.rs_problem("ours reduce_scatter in place", inplace.view(world, -1)[rank]))
    out.zero_()
    work = comm.reduce_scatter(out, src.clone(), async_op=True, key=7)
    if work is not None:
        work.wait()
    found.append(expect.rs_problem("ours reduce_scatter async", out))
    if has_wire:
        inplace = src.clone()
        comm.reduce_scatter(inplace.view(world, -1)[rank], inplace, wire_dtype=torch.bfloat16)
        found.append(expect.rs_wire_problem("ours bf16-wire reduce_scatter in place", inplace.view(world, -1)[rank]))
        out.zero_()
        work = comm.reduce_scatter(out, src.clone(), async_op=True, key=7, wire_dtype=torch.bfloat16)
        if work is not None:
            work.wait()
        found.append(expect.rs_wire_problem("ours bf16-wire reduce_scatter async", out))
    del src, inplace, out
    for dtype in (torch.float32, torch.bfloat16):
        tag = "" if dtype == torch.float32 else " bf16"
        mine = expect.ag_mine.to(dtype)
        full = torch.zeros(numel, dtype=dtype)
        if dtype == torch.float32:
            torch_ag(full, mine)
            found.append(expect.ag_problem(f"torch {torch_ag.__name__}", full))
        full.zero_()
        full.view(world, -1)[rank].copy_(mine)
        comm.all_gather(full, full.view(world, -1)[rank])
        found.append(expect.ag_problem(f"ours all_gather{tag} in place", full))
        full.zero_()
        work = comm.all_gather(full, mine, async_op=True, key=7)
        if work is not None:
            work.wait()
        found.append(expect.ag_problem(f"ours all_gather{tag} async", full))
    return [f for f in found if f]


def _selection(comm: Any) -> list[str]:
    """What comm's own selection functions answer here (names vary while comm is rewritten): every
    function of engine.comm whose name suggests a choice of algorithm and that needs no argument."""
    found = []
    pattern = re.compile(r"(select|use_|algorithm|algo|choose|choice|strategy|impl|native|pairwise)", re.IGNORECASE)
    for name, obj in sorted(vars(comm).items()):
        if not (inspect.isfunction(obj) and obj.__module__.startswith(comm.__name__) and pattern.search(name)):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        required = [
            p
            for p in sig.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:  # a helper of one collective, not a choice
            continue
        try:
            found.append(f"`{name}()` -> {obj()!r}")
        except Exception as exc:  # noqa: BLE001 - report, never fail the benchmark on it
            found.append(f"`{name}()` raised {type(exc).__name__}: {exc}")
    return found


def _as_ring(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with comm's ring schedule chosen (engine/comm/ring.py) for its duration."""

    def run() -> Any:
        os.environ[CHOICE_ENV] = "ring"
        try:
            return fn()
        finally:
            os.environ.pop(CHOICE_ENV, None)

    return run


def _bench_size(comm: Any, dist: Any, mib: float, repeats: int | None, has_wire: bool) -> dict[str, Any]:
    """One buffer size on every rank: check, warm up, time; returns the row (the same on every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch_rs, torch_ag = _torch_collectives(dist)
    t_size = time.perf_counter()
    numel = int(mib * MIB) // 4 // world * world
    shard = numel // world
    reps = repeats or default_repeats(mib)
    size_key = int(mib * 1024)
    expect = _Expect(world, rank, numel, size_key)
    problems = _extra_checks(comm, dist, expect, numel, size_key, has_wire) if mib <= FULL_CHECK_MIB else []

    ar = torch.empty(numel)
    _fill_input(ar, rank, world, size_key)
    ar.mul_(1e-3)  # in-place sums grow by N per call: keep far from overflow
    rs_in = torch.empty(numel)
    rs_out = torch.empty(shard)
    ag_out = torch.empty(numel)
    ag_in = expect.ag_mine.clone()
    ag16_out = torch.empty(numel, dtype=torch.bfloat16)
    ag16_in = expect.ag_mine.bfloat16()

    # Warm-up of ours = the check of the timed forms on fresh inputs + one call's comm_stats bytes.
    t_warm = time.perf_counter()
    traffic: dict[str, dict[str, int]] = {}

    def first_call(name: str, fn: Callable[[], Any], got: torch.Tensor, judge: Callable[..., str | None]) -> None:
        before = comm.comm_stats()["bytes_sent"]
        fn()
        after = comm.comm_stats()["bytes_sent"]
        traffic[name] = {op: after[op] - before.get(op, 0) for op in after if after[op] != before.get(op, 0)}
        problem = judge(f"ours {name}", got)
        if problem:
            problems.append(problem)

    _fill_input(rs_in, rank, world, size_key)
    rs_out.zero_()
    first_call("rs", lambda: comm.reduce_scatter(rs_out, rs_in), rs_out, expect.rs_problem)
    first_call("ag", lambda: comm.all_gather(ag_out, ag_in), ag_out, expect.ag_problem)
    if has_wire:
        _fill_input(rs_in, rank, world, size_key)  # in case the fp32 call used its input as scratch
        rs_in16 = rs_in.bfloat16()  # a bf16 gradient bucket, as the stages fill it (the cast is in the copy)
        rs_out.zero_()
        first_call("bf16_rs", lambda: comm.reduce_scatter(rs_out, rs_in16), rs_out, expect.rs_wire_problem)
    first_call("bf16_ag", lambda: comm.all_gather(ag16_out, ag16_in), ag16_out, expect.ag_problem)
    has_ring = "ring" in getattr(comm, "COLLECTIVES", ())
    if has_ring:
        _fill_input(rs_in, rank, world, size_key)
        rs_out.zero_()
        first_call("ring_rs", _as_ring(lambda: comm.reduce_scatter(rs_out, rs_in)), rs_out, expect.rs_problem)
        ag_out.zero_()
        first_call("ring_ag", _as_ring(lambda: comm.all_gather(ag_out, ag_in)), ag_out, expect.ag_problem)
    del expect

    def z3_ours() -> None:
        comm.all_gather(ag_out, ag_in, key=1)
        comm.all_gather(ag_out, ag_in, key=2)
        comm.reduce_scatter(rs_out, rs_in, key=3)

    fns: dict[str, Callable[[], Any] | None] = {
        "torch_ar": lambda: dist.all_reduce(ar),
        "torch_rs": lambda: torch_rs(rs_out, rs_in),
        "torch_ag": lambda: torch_ag(ag_out, ag_in),
        "ours_rs": lambda: comm.reduce_scatter(rs_out, rs_in),
        "ours_ag": lambda: comm.all_gather(ag_out, ag_in),
        "bf16_rs": (lambda: comm.reduce_scatter(rs_out, rs_in16)) if has_wire else None,
        "bf16_ag": lambda: comm.all_gather(ag16_out, ag16_in),
        "z3_ours": z3_ours,
        "ring_rs": _as_ring(lambda: comm.reduce_scatter(rs_out, rs_in)) if has_ring else None,
        "ring_ag": _as_ring(lambda: comm.all_gather(ag_out, ag_in)) if has_ring else None,
    }
    for name in ("torch_ar", "torch_rs", "torch_ag", "z3_ours"):  # ours were warmed up by the check
        fns[name]()
    t_warm = time.perf_counter() - t_warm
    times: dict[str, list[float]] = {k: [] for k, fn in fns.items() if fn is not None}
    for _ in range(reps):
        for name, fn in fns.items():
            if fn is None:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    # The slowest rank's time per repeat: a collective is done when every rank is.
    names = list(times)
    local = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    all_problems: list[Any] = [None] * world
    dist.all_gather_object(all_problems, problems)
    row = {
        "mib": mib,
        "numel": numel,
        "repeats": reps,
        "full_check": mib <= FULL_CHECK_MIB,
        "median": {n: statistics.median(local[i].tolist()) for i, n in enumerate(names)},
        "best": {n: min(local[i].tolist()) for i, n in enumerate(names)},
        "problems": [f"rank {r}: {p}" for r, ps in enumerate(all_problems) for p in ps],
        "traffic": traffic,
        "seconds": time.perf_counter() - t_size,
    }
    # torch's ZeRO-3 pattern from its parts: its collectives keep no state between calls.
    row["median"]["z3_torch"] = 2 * row["median"]["torch_ag"] + row["median"]["torch_rs"]
    row["warm_s"] = t_warm
    return row


def _bench_world(sizes_mib: list[float], repeats: int | None) -> dict[str, Any]:
    """Runs on every rank of an initialised group; returns rank 0's results (None elsewhere)."""
    import torch.distributed as dist

    from engine import comm

    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.pop(NATIVE_ENV, None)  # "ours" = comm's default selection
    os.environ.pop(CHOICE_ENV, None)
    has_wire = "wire_dtype" in inspect.signature(comm.reduce_scatter).parameters
    torch_rs, torch_ag = _torch_collectives(dist)
    out: dict[str, Any] = {
        "world": world,
        "has_wire": has_wire,
        "selection": _selection(comm),
        "torch_fns": f"{torch_rs.__name__}, {torch_ag.__name__}",
        "comm_file": in_repo(inspect.getsourcefile(comm) or "n/a"),
        "sizes": [],
    }

    for mib in sizes_mib:
        row = _bench_size(comm, dist, mib, repeats, has_wire)
        out["sizes"].append(row)
        if rank == 0:
            print(
                f"[bench_comm] world {world}, {mib:g} MiB: {row['repeats']} repeats, {row['seconds']:.1f} s "
                f"(warm-up and check {row['warm_s']:.1f} s), check {'ok' if not row['problems'] else 'FAILED'}",
                file=sys.stderr,
                flush=True,
            )
        free = getattr(comm, "free_buffers", None)  # drop comm's cached buffers of this size
        if free is not None:
            free()
    return out if rank == 0 else None


def _worker(
    rank: int,
    world: int,
    port: int,
    sizes_mib: list[float],
    repeats: int | None,
    results: mp.Queue[tuple[int, bool, Any]],
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    comm = None
    try:
        from engine import comm  # inside the try: a broken engine/ is reported, not a silent exit

        comm.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600), verbose=False)
        results.put((rank, True, pickle.dumps(_bench_world(sizes_mib, repeats))))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))
    finally:
        if comm is not None:
            comm.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, sizes_mib: list[float], repeats: int | None, timeout: float) -> dict[str, Any]:
    """Spawn `world` ranks, run the benchmark, return rank 0's results (raises on a failed rank)."""
    ctx = mp.get_context("spawn")
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, sizes_mib, repeats, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(outcome))} of {world} did not finish within {timeout:.0f} s"
                )
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died without reporting (exit codes "
                        f"{[procs[r].exitcode for r in dead]}; killed for memory?)"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            outcome[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(outcome) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return outcome[0]


# ---------------------------------------------------------------------------------------------- report side
def _sums(row: dict[str, Any]) -> dict[str, float | None]:
    m = row["median"]

    def add(*keys: str) -> float | None:
        return sum(m[k] for k in keys) if all(k in m for k in keys) else None

    return {
        "torch_rsag": add("torch_rs", "torch_ag"),
        "ours_rsag": add("ours_rs", "ours_ag"),
        "bf16_rsag": add("bf16_rs", "bf16_ag"),
        "ring_rsag": add("ring_rs", "ring_ag"),
    }


def _world_tables(res: dict[str, Any], cores: int) -> list[str]:
    n = res["world"]
    frac = (n - 1) / n
    lines = [f"## {n} ranks", ""]
    if n > cores:
        lines += [
            (
                f"**{n} ranks on {cores} cores: oversubscribed {n / cores:g}x.** Ranks share cores, so these "
                "times include CPU contention (the reductions and copies compete with the transfers); compare "
                "ratios within this table, not seconds with the other world size."
            ),
            "",
        ]
    lines += [
        "Median ms of the slowest rank (bus GB/s in brackets).",
        "",
        (
            "| MiB/rank | torch AR | torch RS | torch AG | torch RS+AG | ours RS | ours AG | ours RS+AG | "
            "ours bf16 RS | ours bf16 AG | ours bf16 RS+AG | ZeRO-3 torch (2 AG + RS) | ZeRO-3 ours | "
            "ring RS | ring AG | ring RS+AG |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in res["sizes"]:
        m, s = row["median"], _sums(row)
        b32 = row["numel"] * 4
        b16 = row["numel"] * 2

        def cell(t: float | None, nbytes: float) -> str:
            return "n/a" if t is None else f"{t * 1e3:.2f} ({nbytes / t / 1e9:.2f})"

        lines.append(
            "| "
            + " | ".join(
                [
                    f"{row['mib']:g}",
                    cell(m["torch_ar"], 2 * frac * b32),
                    cell(m["torch_rs"], frac * b32),
                    cell(m["torch_ag"], frac * b32),
                    cell(s["torch_rsag"], 2 * frac * b32),
                    cell(m["ours_rs"], frac * b32),
                    cell(m["ours_ag"], frac * b32),
                    cell(s["ours_rsag"], 2 * frac * b32),
                    cell(m.get("bf16_rs"), frac * b16),
                    cell(m["bf16_ag"], frac * b16),
                    cell(s["bf16_rsag"], 2 * frac * b16),
                    cell(m["z3_torch"], 3 * frac * b32),
                    cell(m["z3_ours"], 3 * frac * b32),
                    cell(m.get("ring_rs"), frac * b32),
                    cell(m.get("ring_ag"), frac * b32),
                    cell(s["ring_rsag"], 2 * frac * b32),
                ]
            )
            + " |"
        )

    def judged(value: float | None, goal: float, row: dict[str, Any]) -> str:
        if value is None:
            return "n/a"
        if row["problems"]:  # a wrong result earns no "met"
            return f"{value:.2f} (not judged: check failed)"
        return f"{value:.2f} ({'met' if value <= goal else 'missed'})"

    lines += [
        "",
        "Ratios to torch's all-reduce of the same run, and the correctness check:",
        "",
        (
            f"| MiB/rank | torch RS+AG / AR | ours RS+AG / AR (goal <= {GOAL_RS_AG}, theory 1.0) | torch ZeRO-3 / AR | "
            f"ours ZeRO-3 / AR (goal <= {GOAL_ZERO3}, theory 1.5) | bf16 wire / fp32, ours (goal <= {GOAL_BF16}) | "
            "ring RS+AG / AR | repeats | check (ours vs exact) |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in res["sizes"]:
        m, s = row["median"], _sums(row)
        ar = m["torch_ar"]
        bf16 = s["bf16_rsag"] / s["ours_rsag"] if s["bf16_rsag"] is not None else None
        check = "ok" if not row["problems"] else "**FAILED**: " + "; ".join(row["problems"])
        lines.append(
            f"| {row['mib']:g} | {s['torch_rsag'] / ar:.2f} | {judged(s['ours_rsag'] / ar, GOAL_RS_AG, row)} | "
            f"{m['z3_torch'] / ar:.2f} | {judged(m['z3_ours'] / ar, GOAL_ZERO3, row)} | "
            f"{judged(bf16, GOAL_BF16, row)} | "
            f"{'n/a' if s['ring_rsag'] is None else format(s['ring_rsag'] / ar, '.2f')} | "
            f"{row['repeats']} | {check} |"
        )

    lines += [
        "",
        "Bytes one call of ours adds to `comm_stats()['bytes_sent']` (rank 0) / the (N-1)/N volume, MB (1e6 bytes):",
        "",
        "| MiB/rank | ours RS | ours AG | ours bf16-wire RS | ours bf16 AG |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in res["sizes"]:
        t = row["traffic"]
        cells = []
        for key, elem in (("rs", 4), ("ag", 4), ("bf16_rs", 2), ("bf16_ag", 2)):
            theory = frac * row["numel"] * elem
            if key not in t:
                cells.append("n/a")
                continue
            counted = sum(t[key].values())
            ops = "+".join(sorted(t[key])) or "nothing"
            flag = "" if abs(counted - theory) <= 0.01 * theory else " (differs)"
            cells.append(f"{counted / 1e6:.2f} / {theory / 1e6:.2f}{flag}" + (f" [{ops}]" if len(t[key]) != 1 else ""))
        lines.append(f"| {row['mib']:g} | " + " | ".join(cells) + " |")
    return lines


def write_report(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    errors: dict[int, str],
    load_before: tuple[float, ...],
    wall: float,
) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env_native = os.environ.get(NATIVE_ENV)
    lines = [
        f"# Collectives: engine.comm against torch.distributed, gloo over loopback, {cores} cores",
        "",
        (
            f"{datetime.date.today().isoformat()}; torch {torch.__version__}; {os.cpu_count()} cores "
            f"({cores} usable); world sizes {', '.join(map(str, args.worlds))} (real processes, one intra-op "
            f"thread each, OMP_NUM_THREADS=1); per-rank buffers of {', '.join(f'{m:g}' for m in args.sizes_mib)} "
            f"MiB of fp32; whole run {wall:.0f} s."
        ),
        "",
        'What "ours" is: engine.comm.reduce_scatter / all_gather with the default selection '
        f"({NATIVE_ENV} unset in the ranks"
        + (f"; it was {env_native!r} in the caller's environment and was removed" if env_native is not None else "")
        + "). comm's selection functions answered, per world size:",
        "",
    ]
    if load_before[0] > cores - 0.5:
        busy = (
            f"**The machine was busy: load average {load_before[0]:.1f} on {cores} cores before the run.** "
            "Other work shared the cores, so the times are noisy (small sizes most); rerun on an idle "
            "machine before drawing conclusions."
        )
        lines[4:4] = [busy, ""]
    for res in results:
        sel = "; ".join(res["selection"]) or "no selection function found in engine.comm"
        wire = "has" if res["has_wire"] else "has **no**"
        lines.append(
            f"- {res['world']} ranks: {sel}; comm.reduce_scatter {wire} wire_dtype parameter"
            + ("" if res["has_wire"] else " (bf16-wire rows n/a)")
        )
    lines.append("")
    for res in results:
        lines += _world_tables(res, cores) + [""]
    for world, err in errors.items():
        lines += [f"## {world} ranks: failed", "", "```", err.strip()[-3000:], "```", ""]
    lines += ["Notes:", ""] + [
        f"- {n}"
        for n in (
            (
                "Times: each rank waits at a barrier, then times its own call (async_op=False); the slowest rank's time "
                "per repeat is kept and the median over repeats is shown (one warm-up call of each row first, for "
                "ours the checked call below; then every row is timed round-robin, one repeat of each in turn). The sums (RS+AG) add medians; the ZeRO-3 columns are timed "
                "as one sequence all-gather, all-gather, reduce-scatter for ours (fp32, the same buffers); torch's "
                "ZeRO-3 is 2 x its all-gather + its reduce-scatter (medians), not timed as a sequence."
            ),
            (
                "Bus GB/s (1 GB = 1e9 bytes): all-reduce 2(N-1)/N x bytes / t, reduce-scatter and all-gather "
                "(N-1)/N x bytes / t, RS+AG 2(N-1)/N, ZeRO-3 3(N-1)/N; bytes = the per-rank buffer (fp32), for the "
                "bf16 columns the bf16 bytes actually sent (half)."
            ),
            (
                "torch columns call torch.distributed directly (gloo): all_reduce, "
                f"{results[0]['torch_fns'] if results else 'reduce_scatter_single, all_gather_single'} "
                "(the flat-tensor reduce-scatter and all-gather; reduce_scatter_tensor / all_gather_into_tensor in "
                "older torch). bf16 wire = comm.reduce_scatter(fp32 out, bf16 bucket) (fp32 accumulation) "
                "+ comm.all_gather of a bf16 buffer of the same element count; "
                '"bf16 wire / fp32" = its sum over ours fp32 RS+AG. ring = the same fp32 calls with '
                "ZERO_ENGINE_COLLECTIVES=ring (engine/comm/ring.py, checked like ours); with 2 ranks a ring is the "
                "pairwise exchange and comm runs the direct one, so there the ring columns time the same code as "
                "ours and their difference is this machine's noise."
            ),
            (
                "Check, once per configuration (world size and buffer size), on every rank: the first call of each "
                "timed form of ours (out of place, async_op=False: reduce_scatter fp32, bf16-wire reduce_scatter, "
                "all_gather fp32 and bf16) on fresh deterministic inputs, against the exact result each rank computes "
                "locally: reduce_scatter allclose(rtol=atol=1e-5) to the fp32 sum, bf16-wire within (N-1) x 2^-8 x "
                f"sum|x| elementwise, all_gather bit-exact. Up to {FULL_CHECK_MIB:g} MiB also in place, async_op=True "
                "and torch's own results the same way. A failed check voids the row's goals (\"not judged\")."
            ),
            (
                "Traffic: the difference of engine.comm.comm_stats()['bytes_sent'] over one call, against the "
                "(N-1)/N x buffer bytes a ring or pairwise exchange must send (bf16: of the bf16 bytes)."
            ),
        )
    ]
    lines += [
        "",
        "Settings:",
        "",
        f"- command: `python benchmarks/bench_comm.py --sizes-mib {','.join(f'{m:g}' for m in args.sizes_mib)} "
        f"--worlds {','.join(map(str, args.worlds))}" + (f" --repeats {args.repeats}`" if args.repeats else "`"),
        (
            "- repeats: "
            + (
                f"{args.repeats} for every size"
                if args.repeats
                else "by size (10 up to 4 MiB, 7 up to 16, 5 up to 64, 3 above)"
            )
            + " after one warm-up call"
        ),
        f"- engine.comm from {results[0]['comm_file'] if results else 'n/a'}",
        "",
        "Machine:",
        "",
    ] + machine_facts(str(ROOT), load_before, max(args.worlds))
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        sizes = [row["mib"] for row in res["sizes"]]
        series = {
            "torch all-reduce (baseline)": ([row["median"]["torch_ar"] for row in res["sizes"]], "#dd8452", "-"),
            "torch RS+AG": ([_sums(row)["torch_rsag"] for row in res["sizes"]], "#8c8c8c", "-"),
            "ours RS+AG": ([_sums(row)["ours_rsag"] for row in res["sizes"]], "#4c72b0", "-"),
            "ours bf16 wire RS+AG": ([_sums(row)["bf16_rsag"] for row in res["sizes"]], "#55a868", "-"),
            "ring RS+AG" + (" (2 ranks: the direct code)" if res["world"] == 2 else ""): (
                [_sums(row)["ring_rsag"] for row in res["sizes"]],
                "#8172b3",
                "--",
            ),
        }
        for label, (vals, color, style) in series.items():
            pts = [(s, v * 1e3) for s, v in zip(sizes, vals) if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=color, marker="o", label=label)
        ax.plot(
            sizes,
            [row["median"]["torch_ar"] * 1e3 * GOAL_RS_AG for row in res["sizes"]],
            ":",
            color="#dd8452",
            linewidth=1,
            label=f"goal for RS+AG: {GOAL_RS_AG} x all-reduce",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("MiB of fp32 per rank")
        ax.set_ylabel("median ms (lower is better)")
        note = " (oversubscribed)" if res["world"] > (os.cpu_count() or 1) else ""
        ax.set_title(f"{res['world']} ranks{note}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Collectives on gloo, loopback, {os.cpu_count()} cores, torch {torch.__version__}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256", help="per-rank fp32 buffer sizes, MiB")
    parser.add_argument("--worlds", default="2,4", help="world sizes, each run in one set of spawned processes")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per row (default: 10 up to 4 MiB, 7 up to 16, 5 up to 64, 3 above)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per world size before giving up")
    args = parser.parse_args()
    args.sizes_mib = [float(s) for s in args.sizes_mib.split(",") if s.strip()]
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if any(w < 2 for w in args.worlds):
        parser.error("--worlds: every world size must be at least 2")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks before they import torch
    load_before = os.getloadavg()
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    errors: dict[int, str] = {}
    for world in args.worlds:
        try:
            results.append(run_world(world, args.sizes_mib, args.repeats, args.timeout))
        except Exception as exc:  # noqa: BLE001 - report it in the table, go on with the next world size
            errors[world] = f"{type(exc).__name__}: {exc}"
            print(f"[bench_comm] world {world} failed:\n{exc}", file=sys.stderr, flush=True)
    text = write_report(args, results, errors, load_before, time.perf_counter() - start)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    md = os.path.join(RESULTS, "comm.md")
    with open(md, "w") as f:
        f.write(text)
    png = os.path.join(RESULTS, "comm.png")
    if results and plot(results, png):
        print(f"wrote {md} and {png}")
    else:
        print(f"wrote {md}")
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
