"""engine.parallel's tensor-parallel layers against the dense torch layers they split, on real
processes: TP 2 at world 2, TP 2 x DP 2 at world 4 (and TP 1 after it at world 2).

Every rank builds the dense model from the same seed in its own process and compares its TP slice
with the matching slice of the dense result. Tolerance, fp32: a TP layer does the same products as
the dense one but sums a row-parallel dot product as two half-sums plus an all-reduce, so results
differ from dense by rounding only (measured max 2.4e-7 on values of order 1); 1e-6 allows that and
catches any real error (a wrong slice or a missing all-reduce is off by order 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.parallel as mpu
from engine import comm
from engine.config.errors import ConfigError
from tests.distributed import run_distributed

TOL = 1e-6
HIDDEN, FFN, VOCAB, EMBED = 8, 32, 12, 8


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach() - b.detach()).abs().max().item()


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This TP rank's slice of a dense tensor along `dim`."""
    size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    return t.chunk(size, dim=dim)[rank]


def _mlp_errors(parallel_between: bool, seed: int) -> dict[str, float]:
    """Column -> gelu -> Row against nn.Linear -> gelu -> nn.Linear built from the same seed.
    parallel_between: the hidden activation stays split (gather_output=False, input_is_parallel=True)."""
    torch.manual_seed(seed)
    dense1, dense2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    torch.manual_seed(seed)
    col = mpu.ColumnParallelLinear(HIDDEN, FFN, gather_output=not parallel_between)
    row = mpu.RowParallelLinear(FFN, HIDDEN, input_is_parallel=parallel_between)
    # Data differs across data-parallel groups: each TP group computes on its own batch.
    data = torch.Generator().manual_seed(100 + mpu.get_data_parallel_rank())
    x = torch.randn(3, 5, HIDDEN, generator=data)
    probe = torch.randn(3, 5, HIDDEN, generator=data)  # makes every output element's gradient different
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_dense = dense2(F.gelu(dense1(x_dense)))
    y_tp = row(F.gelu(col(x_tp)))
    (y_dense * probe).sum().backward()
    (y_tp * probe).sum().backward()
    assert dense1.weight.grad is not None and dense1.bias.grad is not None
    assert dense2.weight.grad is not None and dense2.bias.grad is not None
    return {
        "init.col.weight": _max_err(col.weight, _rows(dense1.weight, 0)),
        "init.row.weight": _max_err(row.weight, _rows(dense2.weight, 1)),
        "init.row.bias": _max_err(row.bias, dense2.bias),
        "forward": _max_err(y_tp, y_dense),
        "grad.input": _max_err(x_tp.grad, x_dense.grad),
        "grad.col.weight": _max_err(col.weight.grad, _rows(dense1.weight.grad, 0)),
        "grad.col.bias": _max_err(col.bias.grad, _rows(dense1.bias.grad, 0)),
        "grad.row.weight": _max_err(row.weight.grad, _rows(dense2.weight.grad, 1)),
        "grad.row.bias": _max_err(row.bias.grad, dense2.bias.grad),
    }


def _lm_errors(seed: int) -> dict[str, float]:
    """VocabParallelEmbedding -> ColumnParallelLinear(gather_output=False) -> vocab_parallel_cross_entropy
    against nn.Embedding -> nn.Linear -> F.cross_entropy; the TP layers made by from_dense."""
    torch.manual_seed(seed)
    emb, head = nn.Embedding(VOCAB, EMBED, padding_idx=1), nn.Linear(EMBED, VOCAB)
    emb_tp, head_tp = mpu.VocabParallelEmbedding.from_dense(emb), mpu.ColumnParallelLinear.from_dense(head, False)
    data = torch.Generator().manual_seed(200 + mpu.get_data_parallel_rank())
    ids = torch.randint(0, VOCAB, (4, 6), generator=data)
    ids[0, :3] = torch.tensor([0, 1, VOCAB - 1])  # the first and last ids of the vocabulary, the padding id
    target = torch.randint(0, VOCAB, (4, 6), generator=data)
    target[0, :2] = torch.tensor([0, VOCAB - 1])
    loss_dense = F.cross_entropy(head(emb(ids)).reshape(-1, VOCAB), target.reshape(-1))
    loss_tp = mpu.vocab_parallel_cross_entropy(head_tp(emb_tp(ids)), target).mean()
    loss_dense.backward()
    loss_tp.backward()
    assert emb.weight.grad is not None and head.weight.grad is not None and head.bias.grad is not None
    return {
        "lm.embedding": _max_err(emb_tp(ids), emb(ids)),
        "lm.loss": _max_err(loss_tp, loss_dense),
        "lm.grad.embedding": _max_err(emb_tp.weight.grad, _rows(emb.weight.grad, 0)),
        "lm.grad.head.weight": _max_err(head_tp.weight.grad, _rows(head.weight.grad, 0)),
        "lm.grad.head.bias": _max_err(head_tp.bias.grad, _rows(head.bias.grad, 0)),
    }


def _generator_errors() -> dict[str, float]:
    """generator=: the draws come from it (torch's default generator untouched), as nn.Linear's would."""
    torch.manual_seed(5)
    dense = nn.Linear(HIDDEN, FFN)
    torch.manual_seed(0)
    default_state = torch.get_rng_state()
    tp = mpu.ColumnParallelLinear(HIDDEN, FFN, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), default_state)
    assert tp.bias is not None
    return {
        "generator.weight": _max_err(tp.weight, _rows(dense.weight, 0)),
        "generator.bias": _max_err(tp.bias, _rows(dense.bias, 0)),
    }


def _rng_draws() -> dict[str, Any]:
    mpu.model_parallel_manual_seed(1234)
    tracker = mpu.get_rng_tracker()
    ones = torch.ones(64)
    outside_before = F.dropout(ones, 0.5)
    default_state = torch.get_rng_state()
    saved = tracker.get_states()
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    fork_left_default_alone = torch.equal(torch.get_rng_state(), default_state)
    tracker.set_states(saved)
    with mpu.get_cuda_rng_tracker().fork("model-parallel-rng"):
        replay = F.dropout(ones, 0.5)
    with tracker.fork():
        after_replay = F.dropout(ones, 0.5)
    return {
        "outside": outside_before,
        "inside": inside,
        "replayed": torch.equal(inside, replay),
        "advanced": not torch.equal(inside, after_replay),
        "fork_left_default_alone": fork_left_default_alone,
    }


def _errors_raised() -> list[str]:
    tp = mpu.get_tensor_model_parallel_world_size()
    messages = []
    for make in (
        lambda: mpu.ColumnParallelLinear(4, 2 * tp + 1),
        lambda: mpu.RowParallelLinear(2 * tp + 1, 4),
        lambda: mpu.VocabParallelEmbedding(2 * tp + 1, 4),
    ):
        try:
            make()
        except ConfigError as e:
            messages.append(str(e))
    return messages


def _check_tp(world: int) -> dict[str, Any]:
    mpu.initialize_model_parallel(2)
    col = mpu.ColumnParallelLinear(HIDDEN, FFN)
    row = mpu.RowParallelLinear(FFN, HIDDEN)
    out: dict[str, Any] = {
        "errors": {
            **_mlp_errors(True, seed=7),
            **{f"gathered.{k}": v for k, v in _mlp_errors(False, seed=8).items()},
            **_lm_errors(seed=9),
            **_generator_errors(),
        },
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "dp_rank": mpu.get_data_parallel_rank(),
        "attributes": [
            (p.tensor_model_parallel, p.partition_dim, p.partition_stride)  # type: ignore[attr-defined]
            for p in (col.weight, col.bias, row.weight, row.bias)
        ],
        "counted_once": [mpu.param_is_not_tensor_parallel_duplicate(p) for p in (row.weight, row.bias)],
        "rng": _rng_draws(),
        "config_errors": _errors_raised(),
        "tp_calls": comm.comm_stats()["calls"].get("tp.all_reduce", 0),
    }
    if world == 2:  # TP 1 runs the same layers as plain dense ones (every boundary is the identity)
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(1)
        before = dict(comm.comm_stats()["calls"])
        out["tp1_errors"] = {**_mlp_errors(True, seed=7), **_lm_errors(seed=9)}
        out["tp1_collectives"] = {
            k: v - before.get(k, 0) for k, v in comm.comm_stats()["calls"].items() if v != before.get(k, 0)
        }
    mpu.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layers_equal_dense(world: int) -> None:
    results = run_distributed(_check_tp, world, args=(world,))
    for rank, r in enumerate(results):
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, f"rank {rank} (tp {r['tp_rank']}, dp {r['dp_rank']}): TP differs from dense: {bad}"
        # Column weight and bias, row weight: split; row bias: replicated, counted on TP rank 0 only.
        assert r["attributes"] == [(True, 0, 1), (True, 0, 1), (True, 1, 1), (False, -1, 1)]
        assert r["counted_once"] == [True, r["tp_rank"] == 0]
        assert r["tp_calls"] > 0
        assert r["config_errors"] == [
            f"{name} 5 is not divisible by the tensor-parallel size 2; make it a multiple "
            "of 2 or use a tensor_model_parallel_size that divides it"
            for name in ("output_size", "input_size", "num_embeddings")
        ]
        if world == 2:
            bad = {k: v for k, v in r["tp1_errors"].items() if not v <= TOL}
            assert not bad, f"rank {rank} at TP 1: {bad}"
            assert r["tp1_collectives"] == {}

    # Dropout: the same mask across a TP group outside fork(), a different one inside; inside depends
    # on the TP rank only (the two DP replicas of a TP rank agree, as Megatron's seeding gives).
    rng = [r["rng"] for r in results]
    assert all(x["replayed"] and x["advanced"] and x["fork_left_default_alone"] for x in rng)
    assert all(torch.equal(x["outside"], rng[0]["outside"]) for x in rng)
    assert not torch.equal(rng[0]["inside"], rng[1]["inside"])
    assert not torch.equal(rng[0]["inside"], rng[0]["outside"])
    for a, b in zip(results, rng):
        assert torch.equal(b["inside"], rng[a["tp_rank"]]["inside"])


def test_rng_tracker_without_processes() -> None:
    tracker = mpu.RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="no stream 'b'"), tracker.fork("b"):
        pass
    with tracker.fork("a"):
        first = torch.rand(4)
    tracker.reset()
    tracker.add("a", 1)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)  # a stream seeded with 1 draws as torch.manual_seed(1)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(1)))
