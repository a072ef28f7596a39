"""Gradients kept in the accumulation dtype (data_types.grad_accum_dtype; by default the model's dtype,
as in DeepSpeed): accumulated over micro-steps in that dtype exactly as DeepSpeed does, and training
with bf16/fp16 gradient shards tracks training with fp32 accumulation.

DeepSpeed's two accumulation orders, reproduced bit for bit here:
* stages 0-1 accumulate each rank's micro-step gradients locally in the accumulation buffer and
  reduce once at the boundary: round(round(g1 + g2) on rank 0 + the same on rank 1);
* stages 2-3 reduce every micro-step and add the reduced gradient into the shard:
  round(round(g1 on rank 0 + g1 on rank 1) + round(g2 on rank 0 + g2 on rank 1)).

[Note: proving the accumulation dtype on any CPU]
Comparing the losses of a bf16-accumulated and an fp32-accumulated run cannot prove the dtype. At
stage 0 with two micro-steps the fp32 sum is cast to the bf16 wire dtype for the all-reduce (as in
DeepSpeed, communication_data_type unset), the one rounding a bf16 accumulation makes too, so both
runs hand the optimizer the same gradient bit for bit; they differ only in the optimizer path (bf16
rows: the compiled fused Adam; fp32 rows: torch's AdamW), which agree except where torch's sqrt (MKL)
is an ulp off. MKL's code path for non-Intel CPUs is often off (the losses then parted by step 45);
on Intel CPUs, or without the compiled op, the 50 losses were identical and a "losses differ" check
failed. So the dtype is asserted on the rows the step reads and on the accumulation buffer, and the
arithmetic with gradients that are exact elementwise products (no matmul kernel involved) of which
every element rounds differently in bf16/fp16 than in fp32: the same result on every CPU.
"""

from __future__ import annotations

import math
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
fp32 accumulation (stated in docs/precision.md)."""


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
    return batch[0][start : start + MICRO], batch[1][start : start + MICRO]


def _config(stage: int, dtype: str, accum: str | None, gas: int = GAS) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
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
    return _rows_of(stage, summed, layouts, torch.bfloat16)


def _rows_of(stage: int, summed: dict[str, torch.Tensor], layouts: list[Any], dtype: torch.dtype) -> list[torch.Tensor]:
    """Whole gradients (by parameter name) cut into this rank's gradient rows, as the step reads them."""
    rows = []
    for names, layout, rank in layouts:
        flat = torch.zeros(layout.padded_numel, dtype=dtype)
        for name, span in zip(names, layout.params):
            flat[span.offset : span.end] = summed[name].reshape(-1)
        if stage == 3:
            start, end = layout.slice_range(0, rank)
            rows.append(flat[start:end])
        else:
            rows.append(
                flat.view(layout.num_buckets, layout.bucket_numel)[
                    :, rank * layout.slice_numel : (rank + 1) * layout.slice_numel
                ]
            )
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
        assert not torch.equal(
            torch.cat([t.reshape(-1) for t in _expected_rows(stage, local, layouts)]),
            torch.cat([t.reshape(-1) for t in _expected_rows(other, local, layouts)]),
        ), stage


# ------------------------------------------------------------------------ accumulation dtype
PROBE = 64
"""Elements of the probe's one parameter."""
PROBE_GAS = 4
"""One large gradient then three tiny ones per window (a power of two: dividing the loss by it is exact)."""
LOSS_SCALE = 2.0**8
"""fp16's initial_scale_power 8 in _config: the loss scale of the first step."""
RUNS = [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16")]
"""(stage, model dtype) of every run, each with the default accumulation dtype and with fp32."""
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Probe(torch.nn.Module):
    """loss = sum(w * x): the gradient of w is the input itself, times the loss's factor (1/gas, and the
    loss scale), a power of two: an exact product on any CPU, so only the engine's sums round."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(PROBE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x.to(self.w.dtype)).sum()


def _probe_gradients(dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradient each micro-step of a window leaves on w (every rank the same, so the sum over two
    ranks is an exact doubling in any dtype and any reduction order): first b, of `dtype`'s full
    precision and exponents 0-3, then three times b's quarter ulp. Added to b in bf16/fp16 a quarter
    ulp rounds away every time; fp32 keeps all three: 3/4 ulp (rounded up to one ulp where stages 0-1
    cast the sum to the wire dtype)."""
    g = torch.Generator().manual_seed(3)
    digits = -int(math.log2(torch.finfo(dtype).eps))  # 7 (bf16), 10 (fp16): b = (1 + j 2^-digits) 2^e
    exponent = torch.arange(PROBE) % 4
    big = (1 + torch.randint(0, 2**digits, (PROBE,), generator=g) / 2**digits) * 2.0**exponent
    tiny = 2.0 ** (exponent - digits - 2)
    return [big.to(dtype)] + [tiny.to(dtype)] * (PROBE_GAS - 1)


def _expected_probe_gradient(stage: int, grads: list[torch.Tensor], accum: torch.dtype, ws: int) -> torch.Tensor:
    """The sum the engine must hand the step, in `accum` with its rounding at each add (module docstring)."""
    wire = grads[0].dtype  # the model's (communication_data_type unset, as in DeepSpeed)
    if stage < 2:  # each rank sums its micro-steps, then the sum travels in the wire dtype
        acc = grads[0].to(accum)
        for grad in grads[1:]:
            acc += grad
        return (acc.to(wire) * ws).to(accum)
    acc = (grads[0] * ws).to(accum)  # each micro-step reduced, then added into the row
    for grad in grads[1:]:
        acc += (grad * ws).to(accum)
    return acc


def _probe_rows(stage: int, dtype: str, accum: str | None) -> dict[str, Any]:
    """The gradient rows the first step reads after a window of _probe_gradients, and their buffers' dtypes."""
    model = Probe()
    eng, *_ = engine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, dtype, accum, gas=PROBE_GAS)
    )
    stage_of: Any = eng._stage
    seen: list[torch.Tensor] = []
    master_step = stage_of.master_step
    real_step = master_step.step

    def capture(coef: float) -> None:
        seen.extend(t.grad.clone() for t in master_step.targets.values())
        real_step(coef)

    master_step.step = capture
    for grad in _probe_gradients(_LOW[dtype]):  # backward divides by gas (and fp16 scales): exact
        eng.backward(eng(grad.float() * PROBE_GAS))
        eng.step()
    # At stages 0-1 the rows are views of the full-size buffer the micro-steps accumulate in.
    buffers = [t.dtype for t in stage_of._grad_flat.values()] if stage < 2 else []
    layouts = _layouts(eng, stage)
    eng.destroy()
    return {"rows": seen, "buffers": buffers, "layouts": layouts}


def _probe_every_run() -> dict[tuple[int, str, str | None], dict[str, Any]]:
    return {
        (stage, dtype, accum): _probe_rows(stage, dtype, accum) for stage, dtype in RUNS for accum in (None, "fp32")
    }


def test_gradients_accumulate_in_the_configured_dtype_at_every_stage() -> None:
    per_rank = run_distributed(_probe_every_run, 2)  # one pair of processes for every run
    for stage, dtype in RUNS:
        low = _LOW[dtype]
        grads = [g * (LOSS_SCALE if dtype == "fp16" else 1.0) for g in _probe_gradients(low)]
        expected_of = {}
        for accum in (None, "fp32"):
            want = low if accum is None else torch.float32
            where = f"stage {stage}, {dtype}, grad_accum_dtype {accum}"
            expected_of[want] = _expected_probe_gradient(stage, grads, want, ws=2)
            for rank, result in enumerate(r[(stage, dtype, accum)] for r in per_rank):
                rows = result["rows"]
                assert rows and all(t.dtype == want for t in rows), f"{where}: the step reads {want} rows"
                assert all(d == want for d in result["buffers"]), f"{where}: accumulation buffer in {want}"
                expected = _rows_of(stage, {"w": expected_of[want]}, result["layouts"], want)
                assert torch.equal(
                    torch.cat([t.reshape(-1) for t in rows]), torch.cat([t.reshape(-1) for t in expected])
                ), f"{where}, rank {rank}"
        # Every element tells the two dtypes apart, so a run accumulating in the wrong one fails above.
        assert (expected_of[low].float() != expected_of[torch.float32]).all(), (stage, dtype)


# ------------------------------------------------------------------------------ 50-step losses
def _train(stage: int, dtype: str, accum: str | None) -> tuple[list[float | None], set[torch.dtype]]:
    """The loss of every step, and the dtypes of the gradient rows the steps read."""
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
    stage_of: Any = eng._stage
    row_dtypes = {t.grad.dtype for t in stage_of.master_step.targets.values()}
    eng.destroy()
    return losses, row_dtypes


def _train_every_run() -> dict[tuple[int, str, str | None], tuple[list[float | None], set[torch.dtype]]]:
    return {(stage, dtype, accum): _train(stage, dtype, accum) for stage, dtype in RUNS for accum in (None, "fp32")}


def test_low_precision_gradients_track_fp32_accumulation_over_50_steps() -> None:
    runs = run_distributed(_train_every_run, 2, timeout=300)[0]  # one pair of processes for every run
    for stage, dtype in RUNS:
        (low, low_rows), (high, high_rows) = runs[(stage, dtype, None)], runs[(stage, dtype, "fp32")]
        where = f"stage {stage}, {dtype}"
        assert low[-1] < 0.5 * low[0], f"{where}: it trains"
        worst = max(abs(a - b) / b for a, b in zip(low, high))
        assert worst <= TOLERANCE, f"{where}: loss differs by up to {worst:.3%} from fp32 accumulation"
        # The two runs compared are the two dtypes, asserted on the rows rather than by the losses
        # differing, which they need not do (see [Note: proving the accumulation dtype on any CPU]).
        assert low_rows == {_LOW[dtype]} and high_rows == {torch.float32}, f"{where}: {low_rows}, {high_rows}"
