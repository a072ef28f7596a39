"""engine.parallel's process groups: Megatron's rank layout, the mpu accessors, collectives on each
group and their traffic counted per group, on real processes (world 4 = TP 2 x DP 2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine.parallel as mpu
from engine import comm
from engine.config.errors import ConfigError
from tests.distributed import run_distributed


def test_layout_is_megatrons() -> None:
    assert mpu.layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert mpu.layout(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert mpu.layout(2, 1) == ([[0], [1]], [[0, 1]])
    assert mpu.layout(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


@pytest.mark.parametrize(
    "tp,message",
    [
        (3, ("tensor_model_parallel_size 3 does not divide the world size 4; use a divisor of 4 (1, 2, 4)")),
        (0, "must be an int >= 1"),
    ],
)
def test_sizes_that_cannot_work_are_named(tp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mpu.layout(4, tp)


def _groups_at_tp2() -> dict[str, Any]:
    groups = mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    again = mpu.initialize_model_parallel(2)
    rank = comm.get_rank()
    out: dict[str, Any] = {
        "same_again": again is groups,
        "tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(), groups.tp_ranks),
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), groups.dp_ranks),
        "aliases": (
            mpu.get_model_parallel_rank(),
            mpu.get_model_parallel_world_size(),
            mpu.get_model_parallel_group() is mpu.get_tensor_model_parallel_group(),
        ),
        "ranks_of_groups": (
            comm.group_ranks(mpu.get_tensor_model_parallel_group()),
            comm.group_ranks(mpu.get_data_parallel_group()),
        ),
    }
    before = comm.comm_stats()["bytes_sent"]
    x = torch.tensor([float(10**rank)])
    comm.all_reduce(x, group=mpu.get_tensor_model_parallel_group())
    y = torch.tensor([float(10**rank)])
    comm.all_reduce(y, group=mpu.get_data_parallel_group())
    after = comm.comm_stats()["bytes_sent"]
    out["sums"] = (x.item(), y.item())
    out["counted"] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    try:
        mpu.initialize_model_parallel(4)
    except ConfigError as e:
        out["resize"] = str(e)
    mpu.destroy_model_parallel()
    out["after_destroy"] = mpu.model_parallel_is_initialized()
    try:
        mpu.get_data_parallel_rank()
    except RuntimeError as e:
        out["uninitialised"] = str(e)
    return out


def test_tp2_by_dp2_groups_and_their_collectives() -> None:
    results = run_distributed(_groups_at_tp2, 4)
    for rank, got in enumerate(results):
        tp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        dp_ranks = [rank % 2, rank % 2 + 2]
        assert got["same_again"]
        assert got["tp"] == (rank % 2, 2, tuple(tp_ranks))
        assert got["dp"] == (rank // 2, 2, tuple(dp_ranks))
        assert got["aliases"] == (rank % 2, 2, True)
        assert got["ranks_of_groups"] == (tp_ranks, dp_ranks)
        # Sums of 10^rank over each group: only the group's members contribute.
        assert got["sums"] == (sum(10.0**r for r in tp_ranks), sum(10.0**r for r in dp_ranks))
        # Each group's traffic is counted under its own name: 2(N-1)/N of 4 bytes with N = 2.
        assert got["counted"] == {"tp.all_reduce": 4, "dp.all_reduce": 4}
        assert "already initialised with tensor_model_parallel_size 2" in got["resize"]
        assert got["after_destroy"] is False
        assert "initialize_model_parallel" in got["uninitialised"]


def _groups_at_tp1() -> tuple[Any, ...]:
    groups = mpu.initialize_model_parallel()
    out = (
        groups.tp_group,
        groups.dp_group,
        mpu.get_data_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank(),
        groups.dp_ranks,
    )
    mpu.destroy_model_parallel()
    return out


def test_tp1_is_plain_data_parallelism() -> None:
    for rank, got in enumerate(run_distributed(_groups_at_tp1, 2)):
        assert got == (None, None, 2, 0, (0, 1)), rank


def _dp_group_collectives(impl: str) -> dict[str, Any]:
    comm.set_collectives(impl)
    groups = mpu.initialize_model_parallel(2)
    dp = mpu.get_data_parallel_group()
    rank, n = comm.get_rank(), mpu.get_data_parallel_world_size()
    data = torch.arange(8, dtype=torch.float32) + 100 * rank  # 2 slices of 4 per DP member
    out = torch.empty(4)
    before = comm.comm_stats()["bytes_sent"]
    comm.reduce_scatter(out, data, group=dp)
    acc = torch.ones(4)
    comm.reduce_scatter(acc, data, group=dp, accumulate=True)
    gathered = torch.empty(4 * n)
    comm.all_gather(gathered, out, group=dp)
    after = comm.comm_stats()["bytes_sent"]
    result = {
        "out": out,
        "acc": acc,
        "gathered": gathered,
        "dp_ranks": groups.dp_ranks,
        "counted": sorted(k for k in after if after[k] != before.get(k, 0)),
    }
    mpu.destroy_model_parallel()
    comm.set_collectives("engine")
    return result


@pytest.mark.parametrize("impl", ["engine", "ring", "native"])
def test_reduce_scatter_and_all_gather_over_the_data_parallel_group(impl: str) -> None:
    for rank, got in enumerate(run_distributed(_dp_group_collectives, 4, args=(impl,))):
        members = got["dp_ranks"]
        position = members.index(rank)
        full = sum(torch.arange(8, dtype=torch.float32) + 100 * r for r in members)
        mine = full[position * 4 : (position + 1) * 4]
        assert torch.equal(got["out"], mine), (impl, rank)
        assert torch.equal(got["acc"], 1 + mine), (impl, rank)
        assert torch.equal(got["gathered"], full), (impl, rank)
        assert got["counted"] == ["dp.all_gather", "dp.reduce_scatter"], (impl, rank)


class _MegatronStyleMpu:
    """A user's mpu as Megatron-LM writes it: only the older get_model_parallel_* names for TP."""

    def __init__(self, groups: mpu.ParallelGroups, lie_about_dp_rank: bool = False) -> None:
        self._g, self._lie = groups, lie_about_dp_rank

    def get_data_parallel_group(self) -> Any:
        return self._g.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self._g.dp_size

    def get_data_parallel_rank(self) -> int:
        return (self._g.dp_rank + 1) % self._g.dp_size if self._lie else self._g.dp_rank

    def get_model_parallel_group(self) -> Any:
        return self._g.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self._g.tp_size

    def get_model_parallel_rank(self) -> int:
        return self._g.tp_rank


class _NoDataParallel:
    def get_model_parallel_rank(self) -> int:
        return 0


class _ThreeWayData(_MegatronStyleMpu):
    def get_data_parallel_world_size(self) -> int:
        return 3


def _read_user_mpus() -> dict[str, Any]:
    from engine.parallel.user_mpu import groups_from_mpu

    groups = mpu.initialize_model_parallel(2)
    out: dict[str, Any] = {}
    for label, user in (("engine.parallel", mpu), ("megatron-style", _MegatronStyleMpu(groups))):
        got = groups_from_mpu(user)
        out[label] = (got.tp_size, got.dp_size, got.tp_rank, got.dp_rank, got.tp_ranks, got.dp_ranks)
    for label, user in (
        ("missing", _NoDataParallel()),
        ("lying", _MegatronStyleMpu(groups, True)),
        ("oversized", _ThreeWayData(groups)),
    ):
        try:
            groups_from_mpu(user)
        except ConfigError as e:
            out[label] = str(e)
    mpu.destroy_model_parallel()
    return out


def test_user_mpu_objects_are_read_or_refused_by_name() -> None:
    for rank, got in enumerate(run_distributed(_read_user_mpus, 4)):
        want = (2, 2, rank % 2, rank // 2, (rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2))
        assert got["engine.parallel"] == want and got["megatron-style"] == want, rank
        assert got["missing"].startswith(
            "mpu=_NoDataParallel lacks get_data_parallel_group, "
            "get_data_parallel_world_size, get_data_parallel_rank, "
            "get_model_parallel_group, get_model_parallel_world_size"
        ), got["missing"]
        assert "get_data_parallel_world_size/rank() say 2/" in got["lying"], got["lying"]
        assert f"(global rank {rank}) at {rank // 2}" in got["lying"], got["lying"]
        assert (
            "says tensor-parallel size 2 x data-parallel size 3 = 6 ranks, but the world has 4" in got["oversized"]
        ), got["oversized"]
