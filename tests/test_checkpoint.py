"""Checkpoints on real processes and real files: exact resume at stages 0-3, loading at another world
size and stage, a save killed mid-way, damaged files, and consolidation into one state dict."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import free_port, run_distributed
from models import TiedBlocks
from test_stage3 import WIDTH

import engine
from engine.checkpoint import CheckpointError

GLOBAL_BATCH = 8
STEPS = 6  # resume tests: 3 steps, save, load into a fresh engine, 3 more


class Net(TiedBlocks):
    """Three blocks, with dropout before the output and a buffer counting the forwards: both must resume."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__(3, WIDTH)
        self.dropout = dropout
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(torch.nn.functional.dropout(h, self.dropout))  # the RNG state must resume too


def config(stage: int, world: int, precision: str = "fp32") -> dict[str, Any]:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200},
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, WIDTH, generator=g)


def make_engine(stage: int, precision: str = "fp32", dropout: float = 0.1) -> Any:
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=Net(dropout), config=config(stage, torch.distributed.get_world_size(), precision))
    return eng


def train(eng: Any, steps: range) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    micro = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        x, y = batch(step)
        x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        dtype = next(p.dtype for p in eng.module.parameters())
        loss = torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y)
        eng.backward(loss)
        eng.step()
        mean = loss.detach().clone()  # the global batch's loss, whatever the rank count
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _resume(stage: int, precision: str, save_dir: str) -> dict[str, Any]:
    straight = make_engine(stage, precision)
    losses = train(straight, range(STEPS))
    reference = straight.consolidated_state_dict()
    straight.destroy()

    first = make_engine(stage, precision)
    resumed = train(first, range(STEPS // 2))
    first.save_checkpoint(save_dir, client_state={"epoch": 7})
    first.destroy()
    torch.manual_seed(12345)  # the load must restore every RNG, whatever happened since
    second = make_engine(stage, precision)
    path, client = second.load_checkpoint(save_dir)
    resumed += train(second, range(STEPS // 2, STEPS))
    out = {
        "losses": losses,
        "resumed": resumed,
        "client": client,
        "path": path,
        "steps": second.global_steps,
        "lr": second.get_lr(),
        "reference": reference,
        "state": second.consolidated_state_dict(),
    }
    second.destroy()
    return out


@pytest.mark.parametrize(
    "stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")]
)
def test_resume_equals_training_straight_through(tmp_path: Path, stage: int, precision: str) -> None:
    results = run_distributed(_resume, 2, args=(stage, precision, str(tmp_path)))
    for r in results:
        assert r["resumed"] == r["losses"]  # bitwise: every state (masters, Adam, LR, RNG) came back
        assert r["client"] == {"epoch": 7} and r["steps"] == STEPS
        assert r["path"] == str(tmp_path / f"global_step{STEPS // 2}")
    for name, value in results[0]["reference"].items():
        assert torch.equal(value, results[0]["state"][name]), name
    assert (tmp_path / "latest").read_text() == f"global_step{STEPS // 2}"
    manifest = json.loads((tmp_path / f"global_step{STEPS // 2}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["stage"] == stage and manifest["format_version"] == 1
    # Trainable parameters travel only as fp32 master pieces; whole tensors are buffers and frozen
    # parameters (at stage 3 those are shards too).
    head = torch.load(tmp_path / f"global_step{STEPS // 2}" / "rank_0_model_states.pt", weights_only=True)
    frozen = {"blocks.1.norm.weight", "blocks.1.norm.bias"}
    assert set(head["whole"]) == ({"calls"} if stage == 3 else {"calls"} | frozen)
    assert sorted(os.listdir(tmp_path / f"global_step{STEPS // 2}")) == [
        "manifest.json",
        "rank_0_model_states.pt",
        "rank_0_optim_states.pt",
        "rank_1_model_states.pt",
        "rank_1_optim_states.pt",
    ]


def _tiny_resume(save_dir: str, load: bool) -> list[float]:
    """A 5-element unit (Linear(4, 1)) at stage 3 over 2 ranks: rank 1's slice of it is padding only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
    }
    eng, *_ = engine.initialize(model=model, config=config)
    if load:
        eng.load_checkpoint(save_dir, tag="tiny")
    else:
        for _ in range(2):
            eng.backward(eng(torch.ones(1, 4)).sum())
            eng.step()
        eng.save_checkpoint(save_dir, tag="tiny")
    losses = []
    for _ in range(2):
        loss = eng(torch.ones(1, 4)).sum()
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    eng.destroy()
    return losses


def test_stage3_resumes_when_a_rank_holds_only_padding_of_a_unit(tmp_path: Path) -> None:
    """The loaded optimizer state of a master whose slice is all padding had Adam's step but no moments: the
    first step after the load failed (KeyError 'exp_avg') on that rank."""
    straight = run_distributed(_tiny_resume, 2, args=(str(tmp_path), False))
    resumed = run_distributed(_tiny_resume, 2, args=(str(tmp_path), True))
    assert resumed == straight


# ------------------------------------------------------------------------------------ resharding
def _save_then_continue(stage: int, save_dir: str) -> dict[str, Any]:
    eng = make_engine(stage, dropout=0.0)  # dropout masks depend on the rank count
    train(eng, range(3))
    eng.save_checkpoint(save_dir, tag="ckpt")
    losses = train(eng, range(3, STEPS))
    out = {"losses": losses, "state": eng.consolidated_state_dict()}
    eng.destroy()
    return out


def _load_then_continue(stage: int, save_dir: str) -> dict[str, Any]:
    eng = make_engine(stage, dropout=0.0)
    eng.load_checkpoint(save_dir, tag="ckpt")
    losses = train(eng, range(3, STEPS))
    out = {"losses": losses, "state": eng.consolidated_state_dict()}
    eng.destroy()
    return out


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)
    assert a["state"].keys() == b["state"].keys()
    for name in a["state"]:
        torch.testing.assert_close(a["state"][name], b["state"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[str, dict[str, Any]]]:
    """(world size, stage) -> (checkpoint directory, how training continued there): each saved once."""
    out = {}
    for world, stage in ((4, 3), (2, 3), (2, 2)):
        path = str(tmp_path_factory.mktemp(f"w{world}s{stage}"))
        out[(world, stage)] = (path, run_distributed(_save_then_continue, world, args=(stage, path))[0])
    return out


@pytest.mark.parametrize("saved,loaded", [((4, 3), (2, 3)), ((2, 2), (4, 2)), ((4, 3), (1, 3)), ((2, 3), (2, 2))])
def test_checkpoint_loads_at_another_world_size_and_stage(
    saved_checkpoints: dict[tuple[int, int], Any], saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    """Continuing from a checkpoint on another number of ranks (or stage) equals continuing where it
    was saved; only the summation order differs."""
    path, original = saved_checkpoints[saved]
    moved = run_distributed(_load_then_continue, loaded[0], args=(loaded[1], path))[0]
    _close(original, moved)


def _load_without_optimizer(save_dir: str) -> bool:
    trained = make_engine(2, dropout=0.0)
    train(trained, range(1))
    trained.save_checkpoint(save_dir, tag="t")
    saved = trained.consolidated_state_dict()
    trained.destroy()
    evaluation = {k: v for k, v in config(3, 1).items() if k not in ("optimizer", "scheduler")}
    eng, *_ = engine.initialize(model=Net(0.0), config=evaluation)
    eng.load_checkpoint(save_dir, tag="t")
    loaded = eng.consolidated_state_dict()
    eng.destroy()
    return saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_an_engine_without_optimizer_loads_a_training_checkpoint(tmp_path: Path) -> None:
    """Stage 3 without an optimizer holds a block's trainable and frozen parameters in one record; the
    checkpoint has the first as fp32 master pieces, the second whole: each piece is read from where
    its own parameter was saved."""
    assert run_distributed(_load_without_optimizer, 1, args=(str(tmp_path),)) == [True]


# ---------------------------------------------------------------------------------- crash safety
def _save_and_die(save_dir: str, port: int, rank: int) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import datetime

    engine.init_distributed(timeout=datetime.timedelta(seconds=60))
    eng = make_engine(2)
    train(eng, range(2))
    eng.save_checkpoint(save_dir, tag="good")
    train(eng, range(2, 3))
    if rank == 1:
        from engine.checkpoint import store

        real = store.atomic_save

        def die_midway(obj: Any, path: str) -> dict[str, int]:
            if path.endswith("optim_states.pt"):
                with open(path + ".tmp.partial", "wb") as f:
                    f.write(b"half a file")
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, path)

        store.atomic_save = die_midway
    eng.save_checkpoint(save_dir, tag="bad")


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_save_and_die, args=(str(tmp_path), port, r)) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(120)
    assert procs[1].exitcode == -signal.SIGKILL
    procs[0].kill()  # waiting for its dead peer
    procs[0].join(30)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    results = run_distributed(_load_then_continue_tag, 2, args=(str(tmp_path),))
    assert results[0]["path"].endswith("good") and results[0]["steps"] == 2


def _load_then_continue_tag(save_dir: str) -> dict[str, Any]:
    eng = make_engine(2)
    path, _ = eng.load_checkpoint(save_dir)
    train(eng, range(2, 3))
    out = {"path": path, "steps": eng.global_steps - 1}
    eng.destroy()
    return out


# ------------------------------------------------------------------------------- damaged files
def _save_single(save_dir: str) -> None:
    eng = make_engine(3)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="t")
    eng.destroy()


def _load_each(save_dirs: list[str]) -> list[str]:
    """Load each directory's tag "t" in turn; the error message of each (one process for all)."""
    out = []
    for save_dir in save_dirs:
        eng = make_engine(3)
        try:
            eng.load_checkpoint(save_dir, tag="t")
            out.append("loaded")
        except CheckpointError as err:
            out.append(str(err))
        finally:
            eng.destroy()
    return out


def test_damaged_checkpoints_give_named_errors(tmp_path: Path) -> None:
    run_distributed(_save_single, 1, args=(str(tmp_path / "good"),))
    expected: dict[str, str] = {}
    for damage in ("intact", "replaced", "truncated", "corrupted", "missing", "newer", "unchecked"):
        shutil.copytree(tmp_path / "good", tmp_path / damage)
        tag = tmp_path / damage / "t"
        target = tag / "rank_0_optim_states.pt"
        if damage == "intact":
            expected[damage] = "loaded"
        elif damage == "replaced":  # killed between the two renames of a save over the same tag
            tag.rename(tmp_path / damage / ".t.old")
            expected[damage] = "loaded"
        elif damage == "truncated":
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
            expected[damage] = f"{target} was modified or damaged after it was saved ("
        elif damage == "corrupted":
            data = bytearray(target.read_bytes())
            data[: len(data) // 2] = bytes(len(data) // 2)
            target.write_bytes(bytes(data))
            expected[damage] = f"{target} was modified or damaged after it was saved (CRC-32"
        elif damage == "missing":
            target.unlink()
            expected[damage] = f"{target} is missing"
        elif damage == "unchecked":  # saved before manifests had checksums: the reader still names the file
            manifest = json.loads((tag / "manifest.json").read_text())
            del manifest["checksums"]
            (tag / "manifest.json").write_text(json.dumps(manifest))
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
            expected[damage] = f"{target} cannot be read"
        else:
            manifest = json.loads((tag / "manifest.json").read_text())
            manifest["format_version"] = 99
            (tag / "manifest.json").write_text(json.dumps(manifest))
            expected[damage] = "format_version 99, newer than this engine reads (1)"
    got = run_distributed(_load_each, 1, args=([str(tmp_path / d) for d in expected],))[0]
    for (damage, want), message in zip(expected.items(), got):
        assert want in message, (damage, message)


# -------------------------------------------------------------------------------- consolidation
def _train_and_save(save_dir: str) -> dict[str, torch.Tensor]:
    eng = make_engine(3)
    train(eng, range(2))
    eng.save_checkpoint(save_dir)
    state = eng.consolidated_state_dict()
    eng.destroy()
    return state


def test_consolidate_writes_the_models_state_dict(tmp_path: Path) -> None:
    live = run_distributed(_train_and_save, 2, args=(str(tmp_path / "ckpt"),))[0]
    out = tmp_path / "model.pt"
    done = subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(tmp_path / "ckpt"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    assert state.keys() == live.keys()
    for name, value in live.items():
        assert torch.equal(state[name], value), name
    fresh = Net()
    fresh.load_state_dict(state)  # strict: every key, tied weights included
    # Streamed .safetensors (one tensor in memory at a time), read back by the safetensors library.
    from safetensors.torch import load_file

    streamed = tmp_path / "model.safetensors"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.checkpoint.consolidate",
            str(tmp_path / "ckpt"),
            str(streamed),
            "--dtype",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    read = load_file(str(streamed))
    assert read.keys() == live.keys()
    for name, value in live.items():
        assert torch.equal(read[name], value.to(torch.bfloat16) if value.is_floating_point() else value), name
