"""examples/progress.py: the main job's bar prints each update once where the console is not a terminal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from engine.monitor.log import get_logger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from progress import CONSOLE_ENV, LineProgress, progress


def _train(bar: tqdm | LineProgress, steps: int) -> None:
    """What examples/train_gpt.py does with its bar: a postfix and an update per step, the engine's
    log line (steps_per_print) during the last step, then close."""
    for step in range(1, steps + 1):
        if step == steps:
            get_logger().info("step %d | loss 2.0", step)
        bar.set_postfix(loss=f"{5.0 - step:.3f}", samples_s="-" if step == 1 else "90", refresh=False)
        bar.update(1)
    bar.close()


def test_not_a_terminal_prints_each_update_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(CONSOLE_ENV, "0")  # what zrun says when its console is a pipe or a file
    _train(progress(4, 0, "train", "step", disable=False), 4)
    err = capsys.readouterr().err
    assert "\r" not in err  # no redraws for a log to keep
    lines = err.splitlines()
    bars = [line for line in lines if line.startswith("train:")]
    assert [line.split("|")[2].split()[0] for line in bars] == ["1/4", "2/4", "3/4", "4/4"], err
    assert "?step/s" in bars[0] and "?step/s" not in bars[1]  # no rate from the first step's one-time costs
    assert lines.index("[engine] step 4 | loss 2.0") == len(lines) - 2  # logged once, before the last update


def test_a_terminal_gets_tqdms_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONSOLE_ENV, "1")
    bar = progress(4, 1, "train", "step", disable=True)
    assert isinstance(bar, tqdm) and bar.n == 1
    bar.close()
    monkeypatch.delenv(CONSOLE_ENV)  # without zrun: the process's own stderr decides
    monkeypatch.setattr(sys, "stderr", type("Pipe", (), {"isatty": lambda self: False})())
    assert isinstance(progress(4, 0, "train", "step", disable=True), LineProgress)
