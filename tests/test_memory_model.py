"""The estimator (engine.estimate) and the engine's measured memory_report() agree byte for byte on every
model-state category, at every stage, precision and grad_accum_dtype, at world sizes 1, 2 and 4.

The model's widths are not multiples of 128 bytes and the reduce bucket is small, so layout padding
(several buckets at stages 0-2, one group per gather unit at stage 3) is part of what must agree. What
memory_report() holds beyond the model states is the documented constant buffers: the flat stages'
bucket pool (at most two buckets with overlap_comm; empty at stages 0-1 when the accumulation
buffer is in the wire dtype, whose buckets are then views of it), stage 3's gradient buckets and gathered units (none gathered
after a step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine
from engine.monitor.memory import MODEL_STATES
from tests.distributed import run_distributed

WIDTH = 37
BUCKET = 300
"""reduce_bucket_size in elements: several buckets per group at stages 0-2."""
PRECISIONS = [("fp32", None), ("bf16", None), ("bf16", "fp32"), ("fp16", None), ("fp16", "fp32")]
"""(model dtype, data_types.grad_accum_dtype): None is DeepSpeed's default, the model dtype."""
STAGE3_BUFFERS = {"gathered", "peak_gathered"}
NUMEL = 5 * WIDTH + WIDTH + 3 * (WIDTH * WIDTH + WIDTH)


class Blocks(torch.nn.Module):
    """An input layer (stage 3's root unit) and three repeated blocks (one gather unit each)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _config(stage: int, dtype: str, accum: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "overlap_comm": True,
        },
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}  # no overflow-skipped first steps
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    return config


def _measure_every_combination() -> list[dict[str, Any]]:
    ws = torch.distributed.get_world_size()
    rows = []
    for stage in range(4):
        for dtype, accum in PRECISIONS:
            torch.manual_seed(0)
            model = Blocks()
            estimate = engine.estimate_memory(
                model,
                stage=stage,
                world_size=ws,
                dtype=dtype,
                grad_accum_dtype=accum,
                optimizer="adamw",
                bucket_size=BUCKET,
            )
            eng, *_ = engine.initialize(
                model=model, model_parameters=model.parameters(), config=_config(stage, dtype, accum)
            )
            model_dtype = eng.module.inp.weight.dtype
            for _ in range(2):  # the second step runs with the optimizer state in place
                x = torch.randn(4, 5).to(model_dtype)
                eng.backward(eng(x).float().square().mean())
                eng.step()
            assert eng.was_step_applied()
            rows.append(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "accum": accum,
                    "report": eng.memory_report(),
                    "estimate": {k: getattr(estimate, k) for k in MODEL_STATES},
                    "numel": estimate.numel,
                    "padded": estimate.padded_numel,
                    "shard": estimate.shard_numel,
                }
            )
            eng.destroy()
    return rows


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_memory_report_equals_the_estimate(world_size: int) -> None:
    for rank, rows in enumerate(run_distributed(_measure_every_combination, world_size, timeout=300)):
        assert len(rows) == 4 * len(PRECISIONS)
        for row in rows:
            where = f"rank {rank} of {world_size}, stage {row['stage']}, {row['dtype']}, grad_accum {row['accum']}"
            report = row["report"]
            measured = {k: report[k] for k in MODEL_STATES}
            assert measured == row["estimate"], where
            # Padding really is part of it: the model's 4,440 elements are not a multiple of 128 bytes.
            assert row["padded"] > row["numel"] == NUMEL, where
            buffers = {k: v for k, v in report.items() if k not in MODEL_STATES}
            if row["stage"] < 3:
                assert set(buffers) == {"buckets"}, where
                wire = 4 if row["dtype"] == "fp32" else 2  # gradients travel in the model dtype
                accum = 4 if "fp32" in (row["dtype"], row["accum"]) else 2
                bucket = BUCKET + world_size * 128 // wire  # a bucket is rounded up to world x 128 bytes
                # Stages 0-1 reduce views of their accumulation buffer, unless it must be cast to the
                # wire dtype; then, like stage 2, at most two buckets (overlap_comm) are in flight.
                limit = 0 if row["stage"] < 2 and wire == accum else 2 * bucket * wire
                assert buffers["buckets"] <= limit, where
            else:
                assert STAGE3_BUFFERS <= set(buffers), where
                assert buffers["gathered"] == 0, where
        _check_gradient_dtypes({(r["stage"], r["dtype"], r["accum"]): r for r in rows})


def _check_gradient_dtypes(rows: dict[tuple[int, str, str | None], dict[str, Any]]) -> None:
    # DeepSpeed's default (grad_accum_dtype = the model dtype): bf16 training holds 2 bytes of gradient
    # per element, fp32 accumulation 4; the shard is a view of the full buffer at stage 1.
    for stage in range(4):
        low, high = rows[(stage, "bf16", None)]["report"], rows[(stage, "bf16", "fp32")]["report"]
        assert high["gradients"] == 2 * low["gradients"], stage
    stage1 = rows[(1, "bf16", None)]
    assert stage1["report"]["gradients"] == 2 * stage1["padded"]  # the full bf16 buffer and nothing else
    stage3 = rows[(3, "bf16", None)]
    assert stage3["report"]["gradients"] == 2 * stage3["shard"]
    total = sum(stage3["report"][k] for k in MODEL_STATES)
    assert total == 14 * stage3["shard"]  # fp32 master 4 + bf16 gradient 2 + Adam 8; no bf16 shard kept


def test_memory_breakdown_logs_model_states_and_peak_rss(capsys: pytest.CaptureFixture[str]) -> None:
    def run() -> dict[str, int]:
        torch.manual_seed(0)
        model = Blocks()
        config = {**_config(2, "bf16", None), "memory_breakdown": True, "steps_per_print": 1}
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
        eng.backward(eng(torch.randn(4, 5).bfloat16()).float().square().mean())
        eng.step()
        report = eng.memory_report()
        eng.destroy()
        return report

    report = run()  # in this process: a one-rank group, no port opened
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "memory rank 0 |" in line)
    for key in (*MODEL_STATES, "buckets"):
        assert f"{key} {report[key] / 2**20:.2f} MiB" in line, line
    states = sum(report[k] for k in MODEL_STATES)
    assert f"model states {states / 2**20:.2f} MiB ({states / NUMEL:.2f} B/param)" in line, line
    assert "peak RSS" in line and "peak RSS 0.00 MiB" not in line, line
