"""deepspeed.comm's public functions (compat's package, onto engine.comm) on real gloo processes, each
result against the value worked out by hand: the world and subgroups made by new_group, DeepSpeed's
argument order (group before async_op), async handles, and the bytes counted for comm_stats()."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed

import engine

# compat/deepspeed is the folder pip installs as the `deepspeed` distribution; on the path, its package
# imports as-is (the ranks import this module, and with it this line, before unpickling their function).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat" / "deepspeed"))
import deepspeed.comm as dist

F = torch.float64


def _world(impl: str) -> dict[str, Any]:
    """Every function on the whole world; returns what each produced (checked by the parent)."""
    engine.comm.set_collectives(impl)
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.get_world_group()
    out: dict[str, Any] = {
        "rank": (r, dist.get_rank(group=world), dist.get_world_size(world), dist.get_local_rank()),
        "ranks": (
            dist.get_all_ranks_from_group(),
            dist.get_all_ranks_from_group(world),
            dist.get_global_rank(world, 1),
        ),
        "has": (dist.is_available(), dist.is_initialized(), dist.has_all_gather_into_tensor(), dist.get_backend()),
        "has2": (dist.has_reduce_scatter_tensor(), dist.has_all_reduce_coalesced()),
    }
    dist.configure(enabled=True, prof_all=True, verbose=False)
    dist.reset_log()
    # all_reduce in DeepSpeed's positional order (tensor, op, group, async_op).
    x = torch.tensor([r + 1.0, -r], dtype=F)
    out["all_reduce_sync"] = dist.all_reduce(x, dist.ReduceOp.MAX, world)
    out["all_reduce_max"] = x.clone()
    y = torch.full((3,), float(r + 1), dtype=F)
    work = dist.all_reduce(y, dist.ReduceOp.SUM, None, True)
    work.wait()
    out["all_reduce_async"] = y
    # all_gather (a list), all_gather_into_tensor (stacked output), allgather_fn (async).
    parts = [torch.empty(2, 2, dtype=F) for _ in range(n)]
    dist.all_gather(parts, torch.full((2, 2), r * 10.0, dtype=F), world)
    out["all_gather"] = parts
    stacked = torch.empty(n, 3, dtype=torch.int64)
    dist.all_gather_into_tensor(stacked, torch.arange(3) + 100 * r, group=world)
    out["all_gather_into_tensor"] = stacked
    flat = torch.zeros(2 * n, dtype=F)
    dist.allgather_fn(flat, torch.tensor([r, -r], dtype=F), async_op=True).wait()
    out["allgather_fn"] = flat
    # reduce_scatter_tensor (sum, and max through torch's), reduce_scatter_fn, reduce_scatter (a list).
    big = torch.arange(2 * n, dtype=F) + 100 * r
    mine = torch.empty(2, dtype=F)
    dist.reduce_scatter_tensor(mine, big, group=world)
    out["reduce_scatter_tensor"] = mine.clone()
    dist.reduce_scatter_tensor(mine, big, dist.ReduceOp.MAX, world)
    out["reduce_scatter_max"] = mine.clone()
    dist.reduce_scatter_fn(mine, big, async_op=True).wait()
    out["reduce_scatter_fn"] = mine.clone()
    got = torch.empty(2, dtype=F)
    dist.reduce_scatter(got, [torch.full((2,), (r + 1.0) * (i + 1), dtype=F) for i in range(n)], group=world)
    out["reduce_scatter"] = got
    # all_to_all_single, even and uneven splits; all_to_all.
    even = torch.empty(n, dtype=F)
    dist.all_to_all_single(even, torch.tensor([10.0 * r + j for j in range(n)], dtype=F))
    out["all_to_all_even"] = even
    send = torch.cat([torch.full((j + 1,), 100.0 * r + j, dtype=F) for j in range(n)])
    recv = torch.empty(n * (r + 1), dtype=F)
    dist.all_to_all_single(recv, send, [r + 1] * n, [j + 1 for j in range(n)], group=world)
    out["all_to_all_uneven"] = recv
    outs = [torch.empty(1, dtype=F) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([10.0 * r + j], dtype=F) for j in range(n)])
    out["all_to_all"] = outs
    # reduce, gather, scatter, broadcast (DeepSpeed's order: tensor, src, group, async_op).
    red = torch.tensor([r + 1.0], dtype=F)
    dist.reduce(red, n - 1)
    out["reduce"] = red
    gathered = [torch.empty(2, dtype=F) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([r, r * r], dtype=F), gathered, dst=0)
    out["gather"] = gathered
    piece = torch.empty(2, dtype=F)
    dist.scatter(piece, [torch.tensor([j, -j], dtype=F) for j in range(n)] if r == n - 1 else None, src=n - 1)
    out["scatter"] = piece
    b = torch.full((2,), float(r), dtype=F)
    out["broadcast_sync"] = dist.broadcast(b, n - 1, world)
    out["broadcast"] = b.clone()
    b.fill_(r + 0.5)
    dist.broadcast(b, 0, world, True).wait()
    out["broadcast_async"] = b
    objs: list[Any] = [{"from": r}, f"rank{r}"]
    dist.broadcast_object_list(objs, src=1)
    out["broadcast_object_list"] = objs
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, (r, "x" * r))
    out["all_gather_object"] = everyone
    # Coalesced calls (mixed dtypes), inference_all_reduce.
    a, c = torch.full((2,), r + 1.0, dtype=F), torch.full((3,), r + 1, dtype=torch.int64)
    dist.all_reduce_coalesced([a, c], async_op=True).wait()
    out["all_reduce_coalesced"] = (a, c)
    outs_c = [torch.empty(n, dtype=F), torch.empty(2 * n, dtype=torch.int32)]
    dist.all_gather_coalesced(outs_c, [torch.tensor([r], dtype=F), torch.tensor([r, 7], dtype=torch.int32)])
    out["all_gather_coalesced"] = outs_c
    inf = torch.tensor([2.0 * r], dtype=F)
    out["inference_all_reduce"] = dist.inference_all_reduce(inf) is inf, inf
    # Point to point: a ring of isend/irecv, then a blocking send 0 -> n-1.
    ring_in = torch.empty(2, dtype=F)
    handles = [dist.isend(torch.tensor([r, 5.0], dtype=F), (r + 1) % n), dist.irecv(ring_in, (r - 1) % n)]
    for h in handles:
        h.wait()
    out["ring"] = ring_in
    if r == 0:
        dist.send(torch.tensor([42.0, 43.0], dtype=F), n - 1, tag=3)
    elif r == n - 1:
        box = torch.empty(2, dtype=F)
        out["recv"] = (dist.recv(box, 0, tag=3), box)
    dist.barrier()
    dist.barrier(group=world)
    dist.monitored_barrier(wait_all_ranks=True)
    out["stats"] = engine.comm.comm_stats()
    out["log_summary"] = dist.log_summary(return_dict=True)
    out["logged"] = (dist.has_comm_data(), dist.get_comm_operation_count(), dist.get_logged_comm_ops())
    dist.reset_log()
    out["after_reset"] = (dist.has_comm_data(), engine.comm.comm_stats())
    return out


@pytest.mark.parametrize(("world_size", "impl"), [(2, "engine"), (4, "engine"), (4, "ring"), (4, "native")])
def test_every_function_on_the_world(world_size: int, impl: str) -> None:
    n, ranks = world_size, range(world_size)
    results = run_distributed(_world, world_size, args=(impl,), timeout=120)
    tri = n * (n + 1) // 2  # 1 + 2 + ... + n
    for r, got in enumerate(results):

        def t(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=F)

        assert got["rank"] == (r, r, n, r)
        assert got["ranks"] == (list(ranks), list(ranks), 1)
        assert got["has"] == (True, True, True, "gloo") and got["has2"] == (True, True)
        assert got["all_reduce_sync"] is None  # (tensor, op, group): the third argument is the group
        assert torch.equal(got["all_reduce_max"], t([n, 0]))
        assert torch.equal(got["all_reduce_async"], torch.full((3,), float(tri), dtype=F))
        for k in ranks:
            assert torch.equal(got["all_gather"][k], torch.full((2, 2), k * 10.0, dtype=F))
        assert torch.equal(got["all_gather_into_tensor"], torch.stack([torch.arange(3) + 100 * k for k in ranks]))
        assert torch.equal(got["allgather_fn"], t([v for k in ranks for v in (k, -k)]))
        sums = t([n * (2 * r + i) + 100 * sum(ranks) for i in range(2)])
        assert torch.equal(got["reduce_scatter_tensor"], sums) and torch.equal(got["reduce_scatter_fn"], sums)
        assert torch.equal(got["reduce_scatter_max"], t([2 * r + i + 100 * (n - 1) for i in range(2)]))
        assert torch.equal(got["reduce_scatter"], torch.full((2,), float(tri * (r + 1)), dtype=F))
        assert torch.equal(got["all_to_all_even"], t([10.0 * k + r for k in ranks]))
        assert torch.equal(got["all_to_all_uneven"], t([100.0 * k + r for k in ranks for _ in range(r + 1)]))
        assert [o.item() for o in got["all_to_all"]] == [10.0 * k + r for k in ranks]
        if r == n - 1:
            assert got["reduce"].item() == tri
        if r == 0:
            assert [g.tolist() for g in got["gather"]] == [[k, k * k] for k in ranks]
        assert got["scatter"].tolist() == [r, -r]
        assert got["broadcast_sync"] is None
        assert torch.equal(got["broadcast"], torch.full((2,), n - 1.0, dtype=F))
        assert torch.equal(got["broadcast_async"], torch.full((2,), 0.5, dtype=F))
        assert got["broadcast_object_list"] == [{"from": 1}, "rank1"]
        assert got["all_gather_object"] == [(k, "x" * k) for k in ranks]
        a, c = got["all_reduce_coalesced"]
        assert torch.equal(a, torch.full((2,), float(tri), dtype=F)) and c.tolist() == [tri] * 3
        f, i32 = got["all_gather_coalesced"]
        assert f.tolist() == list(ranks) and i32.tolist() == [v for k in ranks for v in (k, 7)]
        assert got["inference_all_reduce"][0] and got["inference_all_reduce"][1].item() == 2 * sum(ranks)
        assert got["ring"].tolist() == [(r - 1) % n, 5.0]
        if r == n - 1:
            sender, box = got["recv"]
            assert sender == 0 and box.tolist() == [42.0, 43.0]

        # Counted for comm_stats(): the calls made since reset_log(), on the world (WORLD's object is
        # the world: no "group." prefix), with the bytes this rank sent.
        stats = got["stats"]
        calls, sent = stats["calls"], stats["bytes_sent"]
        assert not any(op.startswith("group.") for op in calls), calls
        assert calls["all_reduce"] == 3 + 2  # two calls, inference_all_reduce, and two flat dtypes coalesced
        assert calls["all_gather"] == 3 + 2  # a list, a tensor, allgather_fn, two coalesced
        assert calls["reduce_scatter"] == 4  # a tensor (sum, max), reduce_scatter_fn, a list
        assert calls["all_to_all_single"] == 2 and calls["all_to_all"] == 1
        assert sent["all_to_all_single"] == 8 * ((n - 1) + (tri - (r + 1)))  # all but its own piece
        assert sent["all_to_all"] == 8 * (n - 1)
        assert sent["send"] == 16 + (16 if r == 0 else 0)  # the ring's isend, and rank 0's send
        assert sent["gather"] == (0 if r == 0 else 16) and sent["scatter"] == (16 * (n - 1) if r == n - 1 else 0)
        assert calls["broadcast_object_list"] == 1 and sent["all_gather_object"] > 0
        assert got["log_summary"] == stats
        has, count, ops = got["logged"]
        assert has and count == sum(calls.values()) and ops == sorted(calls)
        assert got["after_reset"] == (False, {"bytes_sent": {}, "calls": {}})


def _subgroups(impl: str) -> dict[str, Any]:
    """Groups made by new_group(ranks=...): the even and odd ranks, and rank 0 alone. Every rank makes
    every group in the same order (torch's rule); each uses the one it is in."""
    engine.comm.set_collectives(impl)
    r, n = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group(ranks=[k for k in range(n) if k % 2 == parity]) for parity in (0, 1)]
    alone = dist.new_group([0])
    g, members = halves[r % 2], [k for k in range(n) if k % 2 == r % 2]
    m, p = len(members), members.index(r)
    out: dict[str, Any] = {
        "me": (dist.get_rank(g), dist.get_world_size(g), dist.get_rank(alone), dist.get_world_size(alone)),
        "ranks": (dist.get_all_ranks_from_group(g), dist.get_global_rank(g, m - 1)),
    }
    x = torch.tensor([r + 1.0], dtype=F)
    dist.all_reduce(x, group=g)
    out["all_reduce"] = x
    parts = [torch.empty(1, dtype=F) for _ in range(m)]
    dist.all_gather(parts, torch.tensor([10.0 * r], dtype=F), group=g)
    out["all_gather"] = [v.item() for v in parts]
    flat = torch.empty(2 * m, dtype=F)
    dist.all_gather_into_tensor(flat, torch.tensor([r, -r], dtype=F), group=g, async_op=True).wait()
    out["all_gather_into_tensor"] = flat
    mine = torch.empty(1, dtype=F)
    dist.reduce_scatter_tensor(mine, torch.arange(m, dtype=F) + 100 * r, group=g)
    out["reduce_scatter_tensor"] = mine.item()
    dist.reduce_scatter(mine, [torch.tensor([10.0 * j + r], dtype=F) for j in range(m)], group=g)
    out["reduce_scatter"] = mine.item()
    a2a = torch.empty(m, dtype=F)
    dist.all_to_all_single(a2a, torch.tensor([100.0 * r + j for j in range(m)], dtype=F), group=g)
    out["all_to_all_single"] = a2a
    b = torch.tensor([float(r)], dtype=F)
    dist.broadcast(b, members[-1], g)  # src: a global rank
    out["broadcast"] = b.item()
    red = torch.tensor([r + 1.0], dtype=F)
    dist.reduce(red, members[0], group=g)
    out["reduce"] = red.item() if r == members[0] else None
    gathered = [torch.empty(1, dtype=F) for _ in range(m)] if r == members[0] else None
    dist.gather(torch.tensor([float(r)], dtype=F), gathered, dst=members[0], group=g)
    out["gather"] = None if gathered is None else [v.item() for v in gathered]
    objs: list[Any] = [r]
    dist.broadcast_object_list(objs, members[-1], group=g)
    everyone: list[Any] = [None] * m
    dist.all_gather_object(everyone, f"r{r}", group=g)
    out["objects"] = (objs, everyone)
    if m > 1:  # a send inside the group: first member -> last, both named by global rank
        if p == 0:
            dist.send(torch.tensor([7.0 + r], dtype=F), members[-1], group=g)
        elif p == m - 1:
            box = torch.empty(1, dtype=F)
            out["recv"] = (dist.recv(box, members[0], group=g), box.item())
    dist.barrier(group=g)
    if r == 0:  # the group of rank 0 alone: every collective is the identity
        solo = torch.tensor([3.0, 4.0], dtype=F)
        dist.all_reduce(solo, group=alone)
        both = torch.empty(2, dtype=F)
        dist.all_gather_into_tensor(both, solo, group=alone)
        one = torch.empty(2, dtype=F)
        dist.reduce_scatter_tensor(one, both * 2, group=alone)
        out["alone"] = (solo.tolist(), both.tolist(), one.tolist())
    stats = engine.comm.comm_stats()["calls"]
    out["counted"] = {op: stats.get(f"group.{op}", 0) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    for group in (*halves, alone):
        dist.destroy_process_group(group)
    dist.barrier()  # the world outlives its subgroups
    return out


@pytest.mark.parametrize(("world_size", "impl"), [(2, "engine"), (4, "engine"), (4, "native")])
def test_every_function_on_subgroups(world_size: int, impl: str) -> None:
    results = run_distributed(_subgroups, world_size, args=(impl,), timeout=120)
    for r, got in enumerate(results):
        members = [k for k in range(world_size) if k % 2 == r % 2]
        m, p = len(members), members.index(r)
        assert got["me"] == (p, m, 0 if r == 0 else -1, 1 if r == 0 else -1)
        assert got["ranks"] == (members, members[-1])
        assert got["all_reduce"].item() == sum(k + 1 for k in members)
        assert got["all_gather"] == [10.0 * k for k in members]
        assert got["all_gather_into_tensor"].tolist() == [v for k in members for v in (k, -k)]
        assert got["reduce_scatter_tensor"] == m * p + 100 * sum(members)
        assert got["reduce_scatter"] == m * 10.0 * p + sum(members)
        assert got["all_to_all_single"].tolist() == [100.0 * k + p for k in members]
        assert got["broadcast"] == members[-1]
        if r == members[0]:
            assert got["reduce"] == sum(k + 1 for k in members) and got["gather"] == members
        assert got["objects"] == ([members[-1]], [f"r{k}" for k in members])
        if m > 1 and p == m - 1:
            assert got["recv"] == (members[0], 7.0 + members[0])
        if r == 0:
            assert got["alone"] == ([3.0, 4.0], [3.0, 4.0], [6.0, 8.0])
        # A group made by new_group counts its traffic under "group.<op>".
        assert got["counted"] == {
            "all_reduce": 1 + (r == 0),
            "all_gather": 2 + (r == 0),
            "reduce_scatter": 2 + (r == 0),
        }


def test_lists_of_the_wrong_length_are_refused() -> None:
    # No process group: the world is this process alone, so a list must hold one tensor.
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="expected a list of 1 tensors"):
        dist.all_gather([t, t], t)
    with pytest.raises(ValueError, match="expected a list of 1 tensors"):
        dist.reduce_scatter(t, [torch.zeros(3)])
