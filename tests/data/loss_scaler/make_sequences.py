"""Write deepspeed_0.19.8.json: DeepSpeed's own DynamicLossScaler driven over seeded overflow patterns.

Run under DeepSpeed 0.19.8's venv (made as tests/data/deepspeed_checkpoints/SOURCES.md says), from the
repository root:

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/loss_scaler/make_sequences.py

Each case is a config (init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
scale_factor) and a pattern of overflows ("O") and clean steps ("C"); after every update_scale call the
scale and the remaining hysteresis (cur_hysteresis) are recorded. tests/test_loss_scaler.py replays every
case through engine.precision.loss_scaler.LossScaler and expects the same two sequences.

raise_error_at_min_scale is False in every case: the engine never raises at min_scale (by design, see its
module docstring), and with the flag off DeepSpeed keeps the scale at min_scale too, so patterns may press
against the floor and the two still agree.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

OUT = Path(__file__).resolve().parent / "deepspeed_0.19.8.json"
SEED = 1234


def _init_one_process_group() -> None:
    """update_scale calls deepspeed.comm.get_rank() to decide who logs, so a (1-rank) group must exist."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    deepspeed.init_distributed(dist_backend="gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # one INFO line per overflow otherwise


def _pattern(rng: random.Random, length: int, density: float, bursty: bool) -> str:
    """Independent overflows with probability `density`, or (bursty) runs: stay in the current state with
    probability 0.75, so back-to-back overflows exercise the hysteresis."""
    out: list[str] = []
    overflow = rng.random() < density
    for _ in range(length):
        if bursty:
            if rng.random() >= 0.75:
                overflow = rng.random() < density
        else:
            overflow = rng.random() < density
        out.append("O" if overflow else "C")
    return "".join(out)


def _configs() -> list[dict[str, Any]]:
    """All windows x hysteresis x consecutive with the defaults, then factor 3, odd floors and init scales."""
    base = {"init_scale": 2.0**10, "min_scale": 1.0, "scale_factor": 2.0}
    grid = [
        {**base, "scale_window": w, "delayed_shift": h, "consecutive_hysteresis": c}
        for w, h, c in itertools.product((1, 2, 3, 5), (1, 2, 3), (False, True))
    ]
    extra = [
        # scale_factor 3 (DeepSpeed's constructor fixes 2.0; its optimizers set the attribute afterwards)
        {"init_scale": 3.0**6, "min_scale": 1.0, "scale_factor": 3.0, "scale_window": 2, "delayed_shift": 1},
        {"init_scale": 3.0**6, "min_scale": 1.0, "scale_factor": 3.0, "scale_window": 3, "delayed_shift": 2},
        {"init_scale": 2.0**8, "min_scale": 1.0, "scale_factor": 3.0, "scale_window": 1, "delayed_shift": 3},
        {"init_scale": 1000.0, "min_scale": 2.0, "scale_factor": 3.0, "scale_window": 5, "delayed_shift": 2},
        # floors that are not powers of two, reached by a low start and dense overflows
        {"init_scale": 16.0, "min_scale": 3.0, "scale_factor": 2.0, "scale_window": 2, "delayed_shift": 1},
        {"init_scale": 10.0, "min_scale": 3.0, "scale_factor": 2.0, "scale_window": 3, "delayed_shift": 2},
        {"init_scale": 8.0, "min_scale": 0.75, "scale_factor": 2.0, "scale_window": 1, "delayed_shift": 1},
        {"init_scale": 64.0, "min_scale": 5.0, "scale_factor": 3.0, "scale_window": 2, "delayed_shift": 3},
        {"init_scale": 4.0, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 2, "delayed_shift": 1},
        {"init_scale": 2.0, "min_scale": 0.25, "scale_factor": 2.0, "scale_window": 3, "delayed_shift": 2},
        # other starting scales
        {"init_scale": 2.0**16, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 5, "delayed_shift": 2},
        {"init_scale": 2.0**32, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 3, "delayed_shift": 3},
        {"init_scale": 1.0, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 1, "delayed_shift": 2},
        {"init_scale": 100.0, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 2, "delayed_shift": 2},
        {"init_scale": 0.5, "min_scale": 0.5, "scale_factor": 2.0, "scale_window": 3, "delayed_shift": 1},
        {"init_scale": 2.0**8, "min_scale": 1.0, "scale_factor": 2.0, "scale_window": 2, "delayed_shift": 2},
    ]
    for i, cfg in enumerate(extra):
        cfg["consecutive_hysteresis"] = i % 2 == 1
    return grid + extra


def _run(cfg: dict[str, Any], pattern: str) -> dict[str, list[float] | list[int]]:
    scaler = DynamicLossScaler(
        init_scale=cfg["init_scale"],
        scale_window=cfg["scale_window"],
        min_scale=cfg["min_scale"],
        delayed_shift=cfg["delayed_shift"],
        consecutive_hysteresis=cfg["consecutive_hysteresis"],
        raise_error_at_min_scale=False,
    )
    scaler.scale_factor = cfg["scale_factor"]
    scales: list[float] = []
    hysteresis: list[int] = []
    for step in pattern:
        scaler.update_scale(step == "O")
        scales.append(float(scaler.cur_scale))
        hysteresis.append(int(scaler.cur_hysteresis))
    return {"scales": scales, "hysteresis_left": hysteresis}


def main() -> None:
    _init_one_process_group()
    rng = random.Random(SEED)
    densities = (0.05, 0.15, 0.3, 0.5, 0.8)
    cases = []
    for i, cfg in enumerate(_configs()):
        pattern = _pattern(rng, rng.randint(20, 60), densities[i % len(densities)], bursty=i % 3 == 2)
        cases.append({"config": cfg, "pattern": pattern, **_run(cfg, pattern)})
    header = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "made_by": "tests/data/loss_scaler/make_sequences.py",
    }
    body = ",\n".join(json.dumps(case) for case in cases)  # one case a line keeps the file short and diffable
    OUT.write_text(json.dumps(header)[:-1] + ', "cases": [\n' + body + "\n]}\n")
    print(f"wrote {len(cases)} cases to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
