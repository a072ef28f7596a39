"""Gradients kept in the accumulation dtype (data_types.grad_accum_dtype; by default the model's dtype,
as in DeepSpeed): accumulated over micro-steps in that dtype exactly as DeepSpeed does, and training
with bf16/fp16 gradient shards tracks training with fp32 accumulation.

DeepSpeed's two accumulation orders, reproduced bit for bit here:
* stages 0-1 accumulate each rank's micro-step gradients locally in the accumulation buffer and
  reduce once at the boundary: round(round(g1 + g2) on rank 0 + the same on rank 1);
* stages 2-3 reduce every micro-step and add the reduced gradient into the shard:
  round(round(g1 on rank 0 + g1 on rank 1) + round(g2 on rank 0 + g2 on rank 1)).
"""

from __future__ import annotations

from typing import Any

import torch

import engine
from tests.distributed import run_distributed

WIDTH = 24
GAS = 2
MICRO = 4
STEPS = 50
TOLERANCE = 0.02
"""Largest relative difference of the loss over 50 steps allowed between low-precision gradients and
fp32 accumulation (stated in the README)."""


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _batches(steps: int, ws: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    n = MICRO * GAS * ws
    w = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(n, 8, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def _micro(batch: tuple[torch.Tensor, torch.Tensor], rank: int, ws: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = (k * ws + rank) * MICRO
    return batch[0][start:start + MICRO], batch[1][start:start + MICRO]


def _config(stage: int, dtype: str, accum: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200},
        dtype: {"enabled": True},
    }
    if dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    return config


def _loss(eng: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(p.dtype for p in eng.module.parameters())
    return torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y)


# ------------------------------------------------------------------------ accumulation order
def _first_window_gradients(stage: int) -> dict[str, Any]:
    """The gradient rows the first optimizer step reads, and every rank's bf16 micro-step gradients."""
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Net()
    local = _local_gradients(model, rank, ws)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, "bf16", None))
    seen: list[torch.Tensor] = []
    master_step = eng._stage.master_step
    real_step = master_step.step

    def capture(coef: float) -> None:
        seen.extend(t.grad.clone() for t in master_step.targets.values())
        real_step(coef)

    master_step.step = capture
    batch = _batches(1, ws)[0]
    for k in range(GAS):  # DeepSpeed's loop: step() after every micro-step, applied at the boundary
        eng.backward(_loss(eng, *_micro(batch, rank, ws, k)))
        eng.step()
    layouts = _layouts(eng, stage)
    eng.destroy()
    return {"rows": seen, "local": local, "layouts": layouts}


def _local_gradients(model: Net, rank: int, ws: int) -> list[dict[str, torch.Tensor]]:
    """This rank's gradient of each micro-step, from a bf16 copy of the model, as autograd makes it."""
    twin = Net()
    twin.load_state_dict(model.state_dict())
    twin.bfloat16()
    batch = _batches(1, ws)[0]
    out = []
    for k in range(GAS):
        twin.zero_grad()
        x, y = _micro(batch, rank, ws, k)
        (torch.nn.functional.mse_loss(twin(x.bfloat16()).float(), y) / GAS).backward()
        out.append({n: p.grad.clone() for n, p in twin.named_parameters()})
    return out


def _layouts(eng: Any, stage: int) -> list[tuple[list[str], Any, int]]:
    """(parameter names, layout, rank) of each gradient row block, in the step's target order."""
    if stage == 3:
        return [(g.names, g.layout, torch.distributed.get_rank()) for u in eng._stage.units for g in u.trainable]
    return [(g.names, g.layout, g.rank) for g in eng._stage.groups]


def _expected_rows(stage: int, local: list[list[dict[str, torch.Tensor]]], layouts: list[Any]) -> list[torch.Tensor]:
    ws = len(local)
    if stage < 2:  # accumulate locally in bf16, then one reduction
        summed = {}
        for r in range(ws):
            acc = {n: g.clone() for n, g in local[r][0].items()}
            for n in acc:
                acc[n] += local[r][1][n]
            summed = acc if not summed else {n: summed[n] + acc[n] for n in summed}
    else:  # reduce each micro-step, accumulate the reduced gradient
        summed = {}
        for k in range(GAS):
            reduced = {n: local[0][k][n] + local[1][k][n] for n in local[0][k]}
            summed = reduced if not summed else {n: summed[n] + reduced[n] for n in summed}
    rows = []
    for names, layout, rank in layouts:
        flat = torch.zeros(layout.padded_numel, dtype=torch.bfloat16)
        for name, span in zip(names, layout.params):
            flat[span.offset:span.end] = summed[name].reshape(-1)
        if stage == 3:
            start, end = layout.slice_range(0, rank)
            rows.append(flat[start:end])
        else:
            rows.append(flat.view(layout.num_buckets, layout.bucket_numel)[:, rank * layout.slice_numel:
                                                                            (rank + 1) * layout.slice_numel])
    return rows


def _first_windows() -> dict[int, dict[str, Any]]:
    return {stage: _first_window_gradients(stage) for stage in (1, 2, 3)}


def test_accumulation_over_micro_steps_happens_in_bf16_as_deepspeed_does() -> None:
    per_rank = run_distributed(_first_windows, 2)  # one pair of processes for every stage
    for stage in (1, 2, 3):
        results = [r[stage] for r in per_rank]
        local = [r["local"] for r in results]
        for rank, result in enumerate(results):
            rows = result["rows"]
            assert rows and all(t.dtype == torch.bfloat16 for t in rows), f"stage {stage}: the step reads bf16 rows"
            flat_rows = torch.cat([t.reshape(-1) for t in rows])
            expected = torch.cat([t.reshape(-1) for t in _expected_rows(stage, local, result["layouts"])])
            assert torch.equal(flat_rows, expected), f"stage {stage}, rank {rank}"
        # The two orders really differ (otherwise this test could not tell them apart).
        other = 3 - stage if stage < 3 else 1
        layouts = results[0]["layouts"]
        assert not torch.equal(torch.cat([t.reshape(-1) for t in _expected_rows(stage, local, layouts)]),
                               torch.cat([t.reshape(-1) for t in _expected_rows(other, local, layouts)])), stage


# ------------------------------------------------------------------------------ 50-step losses
def _train(stage: int, dtype: str, accum: str | None) -> list[float]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Net()
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, dtype, accum))
    losses = []
    for batch in _batches(STEPS, ws):
        for k in range(GAS):
            eng.backward(_loss(eng, *_micro(batch, rank, ws, k)))
            eng.step()
        losses.append(eng.get_loss())
    eng.destroy()
    return losses


RUNS = [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16")]


def _train_every_run() -> dict[tuple[int, str, str | None], list[float]]:
    return {(stage, dtype, accum): _train(stage, dtype, accum) for stage, dtype in RUNS for accum in (None, "fp32")}


def test_low_precision_gradients_track_fp32_accumulation_over_50_steps() -> None:
    losses = run_distributed(_train_every_run, 2, timeout=300)[0]  # one pair of processes for every run
    for stage, dtype in RUNS:
        low, high = losses[(stage, dtype, None)], losses[(stage, dtype, "fp32")]
        where = f"stage {stage}, {dtype}"
        assert low[-1] < 0.5 * low[0], f"{where}: it trains"
        worst = max(abs(a - b) / b for a, b in zip(low, high))
        assert worst <= TOLERANCE, f"{where}: loss differs by up to {worst:.3%} from fp32 accumulation"
        assert low != high, f"{where}: the two runs accumulate in different dtypes"
