"""The monitor writers on real processes, read back from what each library wrote: TensorBoard's event
file (tensorboard's own reader), the wandb offline run (its record log, parsed with wandb's protobuf
messages), the Comet offline archive (its messages) and the CSV files; 2 ranks, fp16 so the loss
scale is an event too. Rank 0 writes, once; a missing package is a ConfigError naming the pip command.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import math
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import engine
from engine.config.errors import ConfigError
from tests.distributed import run_distributed

STEPS, MICRO, WORLD = 3, 2, 2
SAMPLES = [MICRO * WORLD * (s + 1) for s in range(STEPS)]
DEEPSPEED_EVENTS = [
    "Train/Samples/train_loss",
    "Train/Samples/lr",
    "Train/Samples/loss_scale",
    "Train/Samples/elapsed_time_ms_forward",
    "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_step",
]
OWN_EVENTS = [
    "Train/Samples/grad_norm",
    "Train/Samples/comm_bytes",
    "Train/Samples/memory/params",
    "Train/Samples/memory/gradients",
    "Train/Samples/memory/optimizer_state",
]


def _config(root: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "job"},
        "wandb": {"enabled": True, "project": "zero-engine-test"},
        "comet": {
            "enabled": True,
            "online": False,
            "project": "zero-engine-test",
            "samples_log_interval": 1,
            "experiment_name": "job",
        },
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": os.path.join(root, "profile.txt")},
    }


def _train(root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=_config(root))
    g = torch.Generator().manual_seed(eng.global_rank)
    losses, lrs = [], []
    for _ in range(STEPS):
        x, y = torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 4, generator=g)
        eng.backward(torch.nn.functional.mse_loss(eng(x.half()).float(), y))
        eng.step()
        losses.append(eng.get_loss())
        lrs.append(eng.get_lr()[0])
    memory = eng.memory_report()
    eng.destroy()
    return {"losses": losses, "lrs": lrs, "memory": memory}


def _wandb_history(run_file: str) -> list[dict[str, Any]]:
    """The history records of a wandb run file: a 7-byte header, then LevelDB log blocks of 32 KiB whose
    records (CRC, length, type; full / first-middle-last fragments) are wandb's Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, fragments, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        fragments += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last fragment
            records.append(fragments)
            fragments = b""
    history = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return history


def test_every_writer_gets_the_events_once_from_rank_0(tmp_path: Path) -> None:
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "COMET_OFFLINE_DIRECTORY": str(tmp_path / "comet"),
    }
    results = run_distributed(_train, WORLD, args=(str(tmp_path),), env=env, timeout=240)
    want = results[0]
    expected_tags = DEEPSPEED_EVENTS + OWN_EVENTS

    # TensorBoard: one event file (rank 0's), every tag at every step, values as the engine reported.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(tmp_path / "tb" / "job" / "events.out.tfevents.*"))
    assert len(files) == 1, files
    board = EventAccumulator(str(tmp_path / "tb" / "job"))
    board.Reload()
    scalars = board.Tags()["scalars"]
    assert set(expected_tags) <= set(scalars), sorted(set(expected_tags) - set(scalars))
    for tag in expected_tags:
        assert [e.step for e in board.Scalars(tag)] == SAMPLES, tag
    for name, key in (("Train/Samples/train_loss", "losses"), ("Train/Samples/lr", "lrs")):
        assert [e.value for e in board.Scalars(name)] == pytest.approx(want[key], rel=1e-6), name
    assert board.Scalars("Train/Samples/loss_scale")[0].value == 2.0**8
    assert [e.value for e in board.Scalars("Train/Samples/memory/params")] == [want["memory"]["params"]] * STEPS
    # samples/s needs the previous step's end: from the second step on; TFLOPs and MFU once the flops
    # profiler measured step 1 (the second step, counting from 0 as DeepSpeed's profile_step does).
    assert [e.step for e in board.Scalars("Train/Samples/samples_per_sec")] == SAMPLES[1:]
    for tag in ("Train/Samples/tflops", "Train/Samples/mfu"):
        assert [e.step for e in board.Scalars(tag)] == SAMPLES[1:], tag
        assert all(e.value > 0 for e in board.Scalars(tag)), tag
    profile = (tmp_path / "profile.txt").read_text()  # rank 0's report, DeepSpeed's layout
    assert "Profile Summary at step 1" in profile and "Detailed Profile per GPU" in profile
    # fwd flops of the MLP on a micro-batch: 2 x rows x (8 x 16 + 16 x 4), counted by FlopCounterMode.
    assert re.search(rf"fwd flops per GPU:\s+{2 * MICRO * (8 * 16 + 16 * 4)}\s*$", profile, re.M), profile

    # wandb, offline: one run, one history row per step at step = global samples.
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    history = _wandb_history(runs[0])
    assert [row["_step"] for row in history] == SAMPLES
    assert [row["Train/Samples/train_loss"] for row in history] == pytest.approx(want["losses"], rel=1e-12)
    assert all(set(expected_tags) <= set(row) for row in history), [sorted(row) for row in history]

    # Comet, offline: one archive whose metric messages carry every event at its step.
    archives = glob.glob(str(tmp_path / "comet" / "*.zip"))
    assert len(archives) == 1, archives
    with zipfile.ZipFile(archives[0]) as archive:
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line.strip()]
        assert json.loads(archive.read("experiment.json"))["project_name"] == "zero-engine-test"
    metrics: dict[str, list[tuple[int, float]]] = {}
    for message in messages:
        if message.get("type") == "metric_msg":
            metric = message["payload"]["metric"]
            metrics.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
    assert set(expected_tags) <= set(metrics), sorted(set(expected_tags) - set(metrics))
    assert [s for s, _ in metrics["Train/Samples/train_loss"]] == SAMPLES
    assert [v for _, v in metrics["Train/Samples/train_loss"]] == pytest.approx(want["losses"], rel=1e-12)

    # CSV (DeepSpeed's csv_monitor): one file per event, a header, a row per step.
    with open(tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == SAMPLES
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(want["losses"], rel=1e-12)
    assert all(math.isfinite(loss) for loss in want["losses"])


@pytest.mark.parametrize(
    "section, module, extra",
    [("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet")],
)
def test_a_writer_without_its_package_is_a_config_error_naming_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, section: str, module: str, extra: str
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, section: {"enabled": True}}
    with pytest.raises(
        ConfigError,
        match=rf"{section}.enabled is true but the {module} package is not installed: "
        rf"pip install 'zero-engine\[{extra}\]'",
    ):
        engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    monkeypatch.undo()
    config[section] = {"enabled": False}  # the failed call left the process able to try again
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    eng.destroy()


def test_progress_log_shows_tflops_and_mfu_after_the_profiled_step(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 1, "detailed": False},
    }
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    with caplog.at_level(logging.INFO, logger="engine"):
        for _ in range(4 * 2):
            eng.backward(eng(torch.randn(4, 32)).square().mean())
            eng.step()
    eng.destroy()
    steps = [r.message for r in caplog.records if r.message.startswith("step ")]
    assert len(steps) == 4 and all("TFLOPs" not in line for line in steps[:2]), steps
    assert all(re.search(r"\| [0-9.]+ TFLOPs/rank \(MFU [0-9.]+% of [0-9.]+\) \|", line) for line in steps[2:]), steps
    printed = capsys.readouterr().out  # no output_file: the report goes to stdout, as DeepSpeed's
    assert "Profile Summary at step 2" in printed and "Detailed Profile per GPU" not in printed
    flops = 2 * 4 * (32 * 64 + 64 * 32)  # one micro-batch's forward
    assert re.search(rf"fwd flops per GPU:\s+{flops / 1e3:.2f} K\s*$", printed, re.M), printed
