"""ZeRO over the data-parallel group with tensor parallelism (Megatron's layers), on real processes:
TP 2 x DP 2 at world 4 and TP 2 x DP 1 at world 2, every stage, against a single-process dense
reference (same global batch, same seed) and against DP 4 of the dense model.

The model is built from engine.parallel's layers, which initialise the full weight as nn.Linear
would and keep this rank's slice, so the dense twin built from the same seed has the same weights.
Gradient clipping is set low enough to act on every step: the clipping factor depends on the global
norm, so a replicated parameter (layer norms, the row-parallel bias) counted twice, or a norm not
reduced over the tensor-parallel group, moves every weight (see [Note: the norm over tensor x data
parallelism] in engine/zero/norm_scope.py).

Tolerance, fp32: the tensor-parallel model sums the row-parallel products as two half-sums plus an
all-reduce, and the data-parallel reduction sums in another order than one process, so weights
differ from the reference by rounding that 20 Adam steps carry along; TOL bounds it (measured in the
module's figures below) and a counting or slicing error is orders of magnitude larger.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.parallel as mpu
from engine import comm
from engine.config.errors import ConfigError
from tests.distributed import run_distributed

TOL = 1e-5
STEPS, MICRO, SEQ = 20, 2, 6
GLOBAL = 8
"""Rows per optimizer step, whatever the data-parallel size: TP 2 x DP 2 takes gradient_accumulation_steps 2,
DP 4 takes 1, DP 1 takes 4 (micro-batches of MICRO rows)."""
VOCAB, D, FFN = 16, 16, 64
CLIP = 0.05


class Block(nn.Module):
    def __init__(self, dense: bool, group: Any) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        if dense:
            self.up: nn.Module = nn.Linear(D, FFN)
            self.down: nn.Module = nn.Linear(FFN, D)
        else:
            self.up = mpu.ColumnParallelLinear(D, FFN, gather_output=False, group=group)
            self.down = mpu.RowParallelLinear(FFN, D, input_is_parallel=True, group=group)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.ln(h))))


class Net(nn.Module):
    def __init__(self, dense: bool, group: Any = None) -> None:
        """group: the tensor-parallel group of the layers (None: engine.parallel's)."""
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(dense, group) for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        with torch.no_grad():  # layer norms that are not the identity: their gradients matter
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.ln_f(h)).reshape(-1, VOCAB), y.reshape(-1))


def _config(stage: int, gas: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000},
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (GLOBAL, SEQ), generator=g), torch.randint(VOCAB, (GLOBAL, SEQ), generator=g)


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the dense model, the whole global batch of every step."""
    model = Net(dense=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _train(
    stage: int, dense: bool, mpu_arg: Any, dp_size: int
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, int]]:
    model = Net(dense=dense, group=getattr(mpu_arg, "tp_group", None))
    gas = GLOBAL // MICRO // dp_size
    before = comm.comm_stats()["bytes_sent"]
    eng, _, _, _ = engine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, gas), mpu=mpu_arg
    )
    assert eng.dp_world_size == dp_size and eng.train_batch_size() == GLOBAL
    dp_rank = eng.parallel.dp_rank
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        for m in range(gas):
            rows = slice((dp_rank * gas + m) * MICRO, (dp_rank * gas + m + 1) * MICRO)
            eng.backward(eng(x[rows], y[rows]))
            eng.step()
        norms.append(eng.get_global_grad_norm())
    state = eng.consolidated_state_dict()
    sent = {op: n - before.get(op, 0) for op, n in comm.comm_stats()["bytes_sent"].items() if n > before.get(op, 0)}
    eng.destroy()
    return state, norms, sent


def _errors(
    state: dict[str, torch.Tensor], norms: list[float], ref: tuple[dict[str, torch.Tensor], list[float]]
) -> dict[str, float]:
    ref_state, ref_norms = ref
    assert set(state) == set(ref_state), (sorted(state), sorted(ref_state))
    return {
        "weights": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state),
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
    }


class MegatronStyleMPU:
    """What a Megatron user passes as mpu=: groups made with torch.distributed itself, tensor-parallel
    ranks consecutive."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        dp_groups = [dist.new_group(list(range(o, world, tp))) for o in range(tp)]
        self.tp_group, self.dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
        self.rank = rank

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp


def _world4() -> dict[str, Any]:
    comm.init_distributed()
    out: dict[str, Any] = {}
    ref = _reference()
    # Stage 1 runs with a user's own mpu object (torch.distributed groups, the older get_model_parallel_*
    # names); the other stages with engine.parallel as the mpu.
    user = MegatronStyleMPU(2)
    mpu.initialize_model_parallel(2)
    for stage in range(4):
        state, norms, sent = _train(stage, dense=False, mpu_arg=user if stage == 1 else mpu, dp_size=2)
        if comm.get_rank() == 0:
            out[f"tp2xdp2 stage {stage}" + (", user mpu" if stage == 1 else "")] = _errors(state, norms, ref)
        if stage == 2:
            out["tp2xdp2 sent"], tp_state = sent, state
    mpu.destroy_model_parallel()
    state, norms, _ = _train(2, dense=True, mpu_arg=None, dp_size=4)
    if comm.get_rank() == 0:
        out["dp4 stage 2"] = _errors(state, norms, ref)
        out["tp2xdp2 against dp4, stage 2"] = {
            "weights": max((tp_state[k] - state[k]).abs().max().item() for k in state)
        }
    return out


def _world2() -> dict[str, Any]:
    comm.init_distributed()
    out: dict[str, Any] = {}
    ref = _reference()
    mpu.initialize_model_parallel(2)
    state, norms, _ = _train(3, dense=False, mpu_arg=None, dp_size=1)  # groups made before: used without mpu=
    if comm.get_rank() == 0:
        out["tp2xdp1 stage 3"] = _errors(state, norms, ref)
    out["other batches"] = _other_batches_per_tp_rank()
    mpu.destroy_model_parallel()
    _, _, out["dp2 sent"] = _train(2, dense=True, mpu_arg=None, dp_size=2)
    out["refusals"] = _refusals()
    return out


def _other_batches_per_tp_rank() -> str:
    """The ranks of one tensor-parallel group fed different batches (a loader sharding by global rank)."""
    model = Net(dense=False)
    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 4))
    x, y = _batch(comm.get_rank())
    try:
        eng(x[:MICRO], y[:MICRO])
    except RuntimeError as err:
        return str(err)
    finally:
        eng.destroy()
    return "no error"


def _refusals() -> list[str]:
    """initialize's named errors for bad tensor-parallel input (every rank raises; the process can go on)."""
    messages = []
    attempts: list[tuple[dict[str, Any], Any]] = [
        ({**_config(2, 1), "tensor_parallel": {"autotp_size": 3}}, None),  # does not divide world 2
        (_config(2, 1), object()),  # an mpu without any of the methods
    ]
    for config, mpu_arg in attempts:
        model = Net(dense=True)
        try:
            engine.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu_arg)
        except ConfigError as err:
            messages.append(str(err))
        else:
            messages.append("no error")
    return messages


def _numel(dense: bool) -> int:
    """Elements one rank holds of the model (tensor-parallel size 2 when not dense)."""
    halved = (FFN * D + FFN) // 2 + FFN * D // 2 + D  # column-parallel weight and bias, row-parallel weight, its bias
    block = 2 * D + (FFN * D + FFN + FFN * D + D if dense else halved)
    return VOCAB * D + 2 * block + 2 * D + D * VOCAB + VOCAB


def test_tensor_x_data_parallel_equals_the_reference_and_sends_less_dp_traffic() -> None:
    four = run_distributed(_world4, 4)[0]
    two = run_distributed(_world2, 2)[0]
    # comm_stats: ZeRO's collectives at TP 2 all run on the data-parallel group ("dp."), the layers'
    # on the tensor-parallel one ("tp."), and a rank's data-parallel bytes shrink with the parameters
    # it holds: half of the split layers, all of the replicated ones (padding aside), against DP 2 of
    # the dense model (the same data-parallel size).
    tp_sent, dp_sent = four["tp2xdp2 sent"], two["dp2 sent"]
    assert "reduce_scatter" not in tp_sent and "all_gather" not in tp_sent, tp_sent
    assert tp_sent["tp.all_reduce"] > 0, tp_sent
    ratio = (tp_sent["dp.reduce_scatter"] + tp_sent["dp.all_gather"]) / (
        dp_sent["reduce_scatter"] + dp_sent["all_gather"]
    )
    expected = _numel(dense=False) / _numel(dense=True)
    print(f"DP bytes at TP 2 / DP-only: {ratio:.3f}, parameters held {expected:.3f}")
    assert abs(ratio - expected) < 0.05, (ratio, expected, tp_sent, dp_sent)
    errors = {
        k: v for k, v in {**four, **two}.items() if not k.endswith("sent") and k not in ("refusals", "other batches")
    }
    print(errors)
    for case, err in errors.items():
        assert err["weights"] < TOL, (case, err)
        assert err.get("norm", 0.0) < 1e-4, (case, err)
    assert len(errors) == 7, sorted(errors)
    assert "ranks [1] got other inputs than rank 0 of their tensor-parallel group [0, 1]" in two["other batches"], two[
        "other batches"
    ]
    not_dividing, no_methods = two["refusals"]
    assert "tensor-parallel size 3" in not_dividing and "world size 2" in not_dividing, not_dividing
    assert "lacks get_data_parallel_group" in no_methods and "get_tensor_model_parallel_rank" in no_methods, no_methods
