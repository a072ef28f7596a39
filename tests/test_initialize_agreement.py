"""engine.initialize on real processes: ranks that built different models are stopped with the first
difference named, a rank that fails alone does not leave the others waiting, and a failed initialize
can be called again in the same processes (under zrun's agent store and under a plain environment
where rank 0 hosts the store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import free_port, run_distributed

import engine
from engine.initialize.rank_agreement import RankMismatchError, first_difference, model_signature

ROOT = Path(__file__).resolve().parent.parent
RETRY_SCRIPT = ROOT / "tests" / "zrun_scripts" / "initialize_retry.py"


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, extra: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.head = torch.nn.Linear(width, 4)
        if extra:
            self.extra = torch.nn.Linear(4, 4)


def _variant_model(variant: str, rank: int) -> torch.nn.Module:
    odd = rank == 1
    if variant == "shape":
        return Net(width=16 if odd else 8)
    if variant == "extra layer":
        return Net(extra=odd)
    if variant == "frozen":
        net = Net()
        net.head.requires_grad_(not odd)
        return net
    if variant == "dtype":
        net = Net()
        return net.double() if odd else net
    raise ValueError(variant)


def _initialize_different(stage: int, variant: str) -> str:
    rank = torch.distributed.get_rank()
    cfg = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    try:
        engine.initialize(model=_variant_model(variant, rank), config=cfg)
    except RankMismatchError as err:
        return str(err)
    return "initialize returned"


# Shapes and extra layers at every stage; frozen and dtype differences (the same check) at two.
CASES = [(stage, variant) for stage in (0, 1, 2, 3) for variant in ("shape", "extra layer")] + [
    (stage, variant) for stage in (0, 3) for variant in ("frozen", "dtype")
]


@pytest.mark.parametrize(("stage", "variant"), CASES)
def test_ranks_that_built_different_models_are_stopped(stage: int, variant: str) -> None:
    messages = run_distributed(_initialize_different, world_size=2, args=(stage, variant), timeout=60)
    expected = {
        "shape": "parameter 'blocks.0.weight' (shape [8, 8], float32, requires_grad) on rank 0 is parameter "
        "'blocks.0.weight' (shape [16, 16], float32, requires_grad) on rank 1",
        "extra layer": "parameter 'extra.weight' (shape [4, 4], float32, requires_grad) exists on rank 1 but not "
        "on rank 0",
        "frozen": "parameter 'head.weight' (shape [4, 8], float32, requires_grad) on rank 0 is parameter "
        "'head.weight' (shape [4, 8], float32, frozen) on rank 1",
        "dtype": "(shape [8, 8], float32, requires_grad) on rank 0 is parameter 'blocks.0.weight' (shape [8, 8], "
        "float64",
    }[variant]
    for rank, message in enumerate(messages):
        assert message.startswith("the ranks built different models: "), f"rank {rank}: {message}"
        assert expected in message, f"rank {rank}: {message}"
        assert "rank(s) [1] differ from rank 0" in message


def _one_rank_differs_of_four() -> str:
    rank = torch.distributed.get_rank()
    try:
        engine.initialize(
            model=Net(extra=rank == 2),
            config={
                "train_batch_size": 4,
                "zero_optimization": {"stage": 3},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            },
        )
    except RankMismatchError as err:
        return str(err)
    return "initialize returned"


def test_the_differing_rank_is_named_among_four() -> None:
    for message in run_distributed(_one_rank_differs_of_four, world_size=4, timeout=90):
        assert "'extra.weight' (shape [4, 4], float32, requires_grad) exists on rank 2 but not on rank 0" in message
        assert "rank(s) [2] differ from rank 0" in message


def test_first_difference_in_words() -> None:
    a = model_signature(Net())
    assert first_difference(a, a[:-1], 0, 3).endswith("exists on rank 0 but not on rank 3")
    assert "exists on rank 5 but not on rank 0" in first_difference(a, model_signature(Net(extra=True)), 0, 5)
    swapped = [a[1], a[0], *a[2:]]
    assert "registered in another order" in first_difference(a, swapped, 0, 1)


def _check_retry_results(lines: list[str]) -> None:
    reports = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    trained = []
    for report in reports:
        rank, results = report["rank"], report["results"]
        assert len(results) == 9, results
        for i in range(3):
            lamb, alone, ok = results[3 * i : 3 * i + 3]
            assert lamb.startswith("ConfigError: optimizer Lamb at zero_optimization.stage 1"), lamb
            if rank == 1:
                assert alone.startswith("ConfigError: ") and "train_batch_sizee" in alone, alone
            else:
                assert alone.startswith(
                    "RankMismatchError: engine.initialize failed on rank(s) [1] (rank 1: ConfigError: "
                ), alone
                assert "train_batch_sizee" in alone
            assert ok.startswith("trained "), ok
            trained.append(ok)
        assert report["group_left"] is False, "the last destroy() must tear down the group initialize made"
    assert len(set(trained)) == 1, f"every rank and round must train identically: {trained}"


def test_failed_initialize_is_retried_under_zrun() -> None:
    # zrun's agent hosts the store and keeps it across groups: a re-created group hung half the time.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZERO_ENGINE_OPS": "fallback"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.zrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(RETRY_SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line.removeprefix("[rank1]:") for line in r.stdout.splitlines() if '"results"' in line]
    _check_retry_results(lines)


def test_failed_initialize_is_retried_without_a_launcher_agent() -> None:
    # No agent (mpirun-style environment variables only): rank 0's process hosts the store.
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(
        PYTHONPATH=str(ROOT),
        ZERO_ENGINE_OPS="fallback",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(RETRY_SCRIPT)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for r in range(2)
    ]
    outputs: list[tuple[Any, Any]] = []
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(out[-3000:] + err[-3000:] for out, err in outputs)
    _check_retry_results([line for out, _ in outputs for line in out.splitlines() if '"results"' in line])
