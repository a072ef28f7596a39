"""DeepSpeed's tensor-fragment functions (deepspeed.utils.safe_get_full_grad and the rest) at stages 0-3
on 2 real ranks, against a single-process torch run of the same global batch.

Each rank: two micro-steps (gradient_accumulation_steps 2); reading a gradient after the first is an
error at stages 0-1 (not reduced yet). After the second, every full gradient is read and compared
with the reference's, then changed (one halved through safe_update_full_grad_vectorized, one replaced
with safe_set_full_grad): the reference makes the same changes, so equal weights and Adam moments after
the step prove the step used them. Then a new fp32 value for one weight must reach the forward, and
writes of optimizer state and (stage 3) local slices must read back exactly.

Tolerances: fp32 reductions sum in another order than the single process (and the engine's Adam may
differ from torch's by an ulp), so values agree to rtol 1e-5 / atol 1e-6; round trips of written values
are exact (every element is held by one rank: the full value is a sum with zeros, engine/zero/fragments.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from models import TiedBlocks

import engine
from engine.zero import tensor_fragment as tf

MICRO, GAS, LR = 4, 2, 1e-2
EPS = 1e-3
"""Adam's first step moves each weight by about lr x g / (|g| + eps): with the default 1e-8, a gradient
near eps turns the summation order's last-bit differences into 1e-5 ones; 1e-3 keeps the step smooth."""
WIDTH = 16
HALVED, REPLACED, RESET = "blocks.0.lin.weight", "inp.bias", "blocks.2.lin.weight"
FROZEN = "blocks.1.norm.weight"
ATOL, RTOL = 1e-6, 1e-5


def make_model() -> TiedBlocks:
    torch.manual_seed(7)
    return TiedBlocks(blocks=3, width=WIDTH)


def batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    n = MICRO * GAS * world
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def micro(data: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, k: int) -> tuple[torch.Tensor, ...]:
    start = (k * world + rank) * MICRO
    return data[0][start : start + MICRO], data[1][start : start + MICRO]


def new_value(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5))


def replacement(shape: torch.Size) -> torch.Tensor:
    return torch.full(shape, 0.01)


def reference(world: int, gas: int = GAS) -> dict[str, Any]:
    """The same global batch in one process, the same gradient changes, torch's Adam."""
    model = make_model()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    x, y = batch(world)
    x, y = x[: MICRO * gas * world], y[: MICRO * gas * world]
    torch.nn.functional.mse_loss(model(x), y).backward()
    named = dict(model.named_parameters())
    grads = {n: p.grad.clone() for n, p in named.items() if p.grad is not None}
    named[HALVED].grad.mul_(0.5)
    named[REPLACED].grad.copy_(replacement(named[REPLACED].shape))
    opt.step()
    out = {
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in named.items() if p.requires_grad},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in named.items() if p.requires_grad},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named.items() if p.requires_grad},
    }
    with torch.no_grad():
        named[RESET].copy_(new_value(named[RESET].shape))
        out["output"] = model(x[:MICRO])
    return out


def full_shape(param: torch.Tensor) -> torch.Size:
    """A stage-3 parameter is empty between uses; DeepSpeed's ds_shape keeps its shape."""
    return getattr(param, "ds_shape", param.shape)


def _error(call: Any) -> str:
    try:
        call()
    except (RuntimeError, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def config(stage: int, gas: int = GAS, **extra: Any) -> dict[str, Any]:
    zero = {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS}},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; the reference does not
        **extra,
        "zero_optimization": zero | extra.get("zero_optimization", {}),
    }


def _train(stage: int, offload: dict[str, Any]) -> dict[str, Any]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=config(stage, zero_optimization=offload))
    named = dict(model.named_parameters())
    trained = [n for n, p in named.items() if p.requires_grad]
    out: dict[str, Any] = {"before_backward": _error(lambda: tf.safe_get_full_grad(named[HALVED]))}
    data = batch(world)
    for k in range(GAS):
        x, y = micro(data, rank, world, k)
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        if k == 0:
            out["mid_window"] = _error(lambda: tf.safe_get_full_grad(named[HALVED]))
            eng.step()  # not the boundary: no optimizer step
    out["grads"] = {n: tf.safe_get_full_grad(named[n]) for n in trained}
    out["frozen"] = (tf.safe_get_full_fp32_param(named[FROZEN]), tf.safe_get_full_grad(named[FROZEN]))
    tf.safe_update_full_grad_vectorized([named[n] for n in trained], lambda g, p: g * 0.5 if p is named[HALVED] else g)
    tf.safe_set_full_grad(named[REPLACED], replacement(full_shape(named[REPLACED])))
    out["replaced"] = tf.safe_get_full_grad(named[REPLACED])
    eng.step()
    out["params"] = {n: tf.safe_get_full_fp32_param(named[n]) for n in trained}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: tf.safe_get_full_optimizer_state(named[n], key) for n in trained}
    out["missing_state"] = _error(lambda: tf.safe_get_full_optimizer_state(named[HALVED], "momentum_buffer"))
    out["after_step"] = _error(lambda: tf.safe_get_full_grad(named[HALVED]))

    # A new fp32 value reaches the forward; written optimizer state reads back exactly.
    tf.safe_set_full_fp32_param(named[RESET], new_value(full_shape(named[RESET])))
    out["reset"] = tf.safe_get_full_fp32_param(named[RESET])
    with torch.no_grad():
        out["output"] = eng(data[0][:MICRO])
    doubled = out["exp_avg_sq"][HALVED] * 2
    tf.safe_set_full_optimizer_state(named[HALVED], doubled, "exp_avg_sq")
    out["doubled"] = torch.equal(tf.safe_get_full_optimizer_state(named[HALVED], "exp_avg_sq"), doubled)
    out["wrong_size"] = _error(lambda: tf.safe_set_full_fp32_param(named[RESET], torch.zeros(3)))
    if stage == 3:
        out["local"] = {n: tf.safe_get_local_fp32_param(named[n]) for n in trained}
        out["local_exp_avg"] = {n: tf.safe_get_local_optimizer_state(named[n], "exp_avg") for n in trained}
        mine = tf.safe_get_local_fp32_param(named[HALVED])
        tf.safe_set_local_fp32_param(named[HALVED], mine + 1.0)
        out["local_plus_one"] = tf.safe_get_full_fp32_param(named[HALVED])
        out["local_frozen"] = tf.safe_get_local_fp32_param(named[FROZEN])
    else:
        out["local_refused"] = _error(lambda: tf.safe_get_local_fp32_param(named[HALVED]))
    eng.destroy()
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(
    "stage, world, offload",
    [
        (0, 2, None),
        (1, 2, None),
        (2, 2, None),
        (3, 2, None),
        (2, 1, None),
        (1, 4, None),
        (3, 4, None),
        (2, 2, "cpu"),
        (3, 2, "nvme"),
    ],
)
def test_full_values_match_single_process(stage: int, world: int, offload: str | None, tmp_path: Path) -> None:
    ref = reference(world)
    where_to = {"device": offload, "nvme_path": str(tmp_path)} if offload == "nvme" else {"device": offload}
    keys = {"offload_optimizer": where_to} if offload else {}
    results = run_distributed(_train, world, args=(stage, keys))
    for rank, out in enumerate(results):
        where = f"stage {stage}, rank {rank} of {world}, offload {offload}"
        assert "not available" in out["before_backward"], out["before_backward"]
        if stage < 2:  # reduced only in the boundary backward
            assert "not available" in out["mid_window"], out["mid_window"]
        else:
            assert out["mid_window"] == "no error"
        assert "not available" in out["after_step"], out["after_step"]
        assert set(out["grads"]) == set(ref["grads"]), where
        for name, grad in ref["grads"].items():
            assert out["grads"][name].dtype == torch.float32
            _close(out["grads"][name], grad, f"{where}: gradient of {name}")
        assert out["frozen"] == (None, None), where
        assert torch.equal(out["replaced"], replacement(out["replaced"].shape)), where
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            for name, value in ref[kind].items():
                _close(out[kind][name], value, f"{where}: {kind} of {name} after the step")
        assert torch.equal(out["reset"], new_value(out["reset"].shape)), where
        _close(out["output"], ref["output"], f"{where}: forward after safe_set_full_fp32_param")
        assert out["doubled"], where
        assert "KeyError" in out["missing_state"] and "exp_avg" in out["missing_state"], out["missing_state"]
        assert "ValueError" in out["wrong_size"] and RESET in out["wrong_size"], out["wrong_size"]
        if stage < 3:
            assert "only ZeRO stage 3" in out["local_refused"], out["local_refused"]
    if stage == 3:  # each rank's local slices, in rank order, are the full value
        for name, full in results[0]["params"].items():
            full = results[0]["reset"] if name == RESET else full  # read after it was reset
            joined = torch.cat([out["local"][name] for out in results])
            assert torch.equal(joined, full.reshape(-1)), name
            moments = torch.cat([out["local_exp_avg"][name] for out in results])
            assert torch.equal(moments, results[0]["exp_avg"][name].reshape(-1)), name
        for out in results:
            assert torch.equal(out["local_plus_one"], results[0]["params"][HALVED] + 1.0)
            assert out["local_frozen"] is None


def _low_precision(stage: int, dtype: str) -> dict[str, Any]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    precision = (
        {"fp16": {"enabled": True, "initial_scale_power": 10}} if dtype == "fp16" else {"bf16": {"enabled": True}}
    )
    eng, _, _, _ = engine.initialize(model=model, config=config(stage, gas=1, **precision))
    named = dict(model.named_parameters())
    x, y = micro(batch(world), rank, world, 0)
    out: dict[str, Any] = {"loss_scale": eng.optimizer.cur_scale if dtype == "fp16" else 1.0}
    low = torch.float16 if dtype == "fp16" else torch.bfloat16
    eng.backward(torch.nn.functional.mse_loss(eng(x.to(low)).float(), y))
    out["grads"] = {n: tf.safe_get_full_grad(p) for n, p in named.items() if p.requires_grad}
    value = new_value(full_shape(named[RESET]))
    tf.safe_set_full_fp32_param(named[RESET], value)
    out["master_kept"] = torch.equal(tf.safe_get_full_fp32_param(named[RESET]), value)  # fp32, not rounded
    with engine.zero.GatheredParameters([named[RESET]]):
        out["forward_reads"] = named[RESET].data.clone()
    eng.destroy()
    return out


@pytest.mark.parametrize("stage, dtype", [(2, "fp16"), (3, "fp16"), (1, "bf16"), (3, "bf16")])
def test_low_precision(stage: int, dtype: str) -> None:
    """Gradients come without fp16's loss scale (1024 here: a scaled one would be 1000x off); a new fp32 value
    is kept in fp32 in the master and reaches the forward's parameter rounded to its dtype. Tolerance: the
    gradient of a model run in fp16 (bf16) against one run in fp32, relative 2e-2 (8e-2) of its largest element."""
    world = 2
    ref = reference(world, gas=1)["grads"]
    for rank, out in enumerate(run_distributed(_low_precision, world, args=(stage, dtype))):
        assert dtype == "bf16" or out["loss_scale"] == 1024.0, out["loss_scale"]
        for name, grad in ref.items():
            got = out["grads"][name]
            assert got.dtype == torch.float32
            bound = (2e-2 if dtype == "fp16" else 8e-2) * float(grad.abs().max())
            assert float((got - grad).abs().max()) <= bound, f"{dtype} stage {stage} rank {rank}: gradient of {name}"
        assert out["master_kept"], f"{dtype} stage {stage} rank {rank}"
        value = new_value(out["forward_reads"].shape)
        assert torch.equal(out["forward_reads"], value.to(out["forward_reads"].dtype))
