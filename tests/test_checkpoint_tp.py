"""Checkpoints under tensor parallelism (engine/checkpoint/tensor_parallel.py, tp_recut.py), on real
processes with the TP model of test_tensor_parallel.py: TP 2 x DP 2 saves at stage 2 and resumes at
stage 3; TP 2 x DP 1 loads the same checkpoint (another data-parallel size); TP 1 x DP 4, TP 4 x DP 1
and TP 1 x DP 1 load it at another tensor-parallel size (each slice, masters and Adam moments, re-cut
from the whole tensor) and continue to the same weights; a checkpoint saved without tensor parallelism
loads at TP 2; consolidate joins the slices. The RNG tracker's streams (dropout inside
tensor-parallel regions) travel with each rank's RNG states.

Tolerances, fp32: the load itself is exact (every rank reads back its own slice's values bit for
bit). Continuing at the same TP x DP at another stage is within 1e-6 (measured: bitwise); at
DP 1 each step's gradient is summed in one process's micro-batches of 4 rows instead of two ranks'
of 2, a rounding difference that 3 Adam steps carry to at most RESUME_TOL_DP (measured in the
figures printed; a wrong slice or a lost Adam state is orders of magnitude larger). At another
tensor-parallel size the row-parallel sums are added in another order: the same bound holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import engine
import engine.parallel as mpu
from engine import comm
from engine.checkpoint.consolidate import consolidate, write_safetensors
from engine.checkpoint.files import load_file
from engine.checkpoint.rng import rng_state, set_rng_state
from engine.parallel.random import MODEL_PARALLEL_RNG
from tests.distributed import run_distributed
from tests.test_tensor_parallel import FFN, GLOBAL, D, Net, _batch, _config

SAVE_AT, STEPS = 3, 6
GAS = 2
RESUME_TOL = 1e-6
RESUME_TOL_DP = 1e-5


def _engine(stage: int, dense: bool = False) -> Any:
    """The test model at the current groups (engine.parallel's, made before: no mpu= needed), GAS
    micro-batches per step at any data-parallel size (the saved micro-step counter places the next
    accumulation boundary)."""
    dp_size = comm.get_world_size() // (
        mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    )
    config = _config(stage, GAS)
    config["train_micro_batch_size_per_gpu"] = GLOBAL // GAS // dp_size
    eng, *_ = engine.initialize(model=Net(dense=dense), config=config)
    return eng


def _train(eng: Any, steps: range) -> None:
    """The same global batches at any data-parallel size: each DP rank its rows, in micro-batches."""
    micro, dp_rank = eng.train_micro_batch_size_per_gpu(), eng.parallel.dp_rank
    for step in steps:
        x, y = _batch(step)
        for m in range(GAS):
            rows = slice((dp_rank * GAS + m) * micro, (dp_rank * GAS + m + 1) * micro)
            eng.backward(eng(x[rows], y[rows]))
            eng.step()


def _world4(save_dir: str) -> dict[str, Any]:
    comm.init_distributed()
    mpu.initialize_model_parallel(2)
    out: dict[str, Any] = {}
    eng = _engine(2)
    _train(eng, range(SAVE_AT))
    eng.save_checkpoint(save_dir, tag="tp2")
    out["saved"] = eng.consolidated_state_dict()
    _train(eng, range(SAVE_AT, STEPS))
    out["reference"] = eng.consolidated_state_dict()
    eng.destroy()

    eng = _engine(3)
    eng.load_checkpoint(save_dir, tag="tp2")
    out["loaded"] = eng.consolidated_state_dict()
    _train(eng, range(SAVE_AT, STEPS))
    out["resumed"] = eng.consolidated_state_dict()
    eng.destroy()
    mpu.destroy_model_parallel()

    eng = _engine(1, dense=True)  # TP 1 x DP 4: the slices re-cut into whole tensors
    eng.load_checkpoint(save_dir, tag="tp2")
    out["tp1 dp4 loaded"] = eng.consolidated_state_dict()
    _train(eng, range(SAVE_AT, STEPS))
    out["tp1 dp4 resumed"] = eng.consolidated_state_dict()
    eng.destroy()

    mpu.initialize_model_parallel(4)  # TP 4 x DP 1: each slice of 2 cut in two
    eng = _engine(2)
    eng.load_checkpoint(save_dir, tag="tp2")
    out["tp4 dp1 loaded"] = eng.consolidated_state_dict()
    _train(eng, range(SAVE_AT, STEPS))
    out["tp4 dp1 resumed"] = eng.consolidated_state_dict()
    eng.destroy()
    mpu.destroy_model_parallel()

    eng = _engine(1, dense=True)  # DP 4 without TP: a checkpoint the TP run at world 2 loads
    eng.save_checkpoint(os.path.join(save_dir, "dense"), tag="dp4")
    out["dense saved"] = eng.consolidated_state_dict()
    eng.destroy()
    return out


def _world1(save_dir: str) -> dict[str, Any]:
    comm.init_distributed()
    eng = _engine(3, dense=True)  # TP 1 x DP 1
    eng.load_checkpoint(save_dir, tag="tp2")
    out = {"loaded": eng.consolidated_state_dict()}
    _train(eng, range(SAVE_AT, STEPS))
    out["resumed"] = eng.consolidated_state_dict()
    eng.destroy()
    return out


def _world2(save_dir: str) -> dict[str, Any]:
    comm.init_distributed()
    mpu.initialize_model_parallel(2)
    out: dict[str, Any] = {}
    eng = _engine(1)  # TP 2 x DP 1: the data-parallel size changes, the slices do not
    eng.load_checkpoint(save_dir, tag="tp2")
    out["loaded"] = eng.consolidated_state_dict()
    _train(eng, range(SAVE_AT, STEPS))
    out["resumed"] = eng.consolidated_state_dict()
    eng.load_checkpoint(os.path.join(save_dir, "dense"), tag="dp4")  # saved without TP, cut in two
    out["dense into tp2"] = eng.consolidated_state_dict()
    eng.destroy()
    mpu.destroy_model_parallel()
    return out


def _max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_tensor_parallel_checkpoint_reshards_over_dp_and_tp_and_consolidates(tmp_path: Path) -> None:
    four = run_distributed(_world4, 4, args=(str(tmp_path),))[0]
    two = run_distributed(_world2, 2, args=(str(tmp_path),))[0]
    one = run_distributed(_world1, 1, args=(str(tmp_path),))[0]
    saved, reference = four["saved"], four["reference"]
    assert saved["blocks.0.up.weight"].shape == (FFN, D)  # the whole model, slices joined

    # Every rank reads back its own slices exactly, at another stage and at another DP size.
    assert _max_error(four["loaded"], saved) == 0.0
    assert _max_error(two["loaded"], saved) == 0.0
    same_dp, other_dp = _max_error(four["resumed"], reference), _max_error(two["resumed"], reference)
    print(f"3 steps after the load: TP2xDP2 stage 3 {same_dp:.2e}, TP2xDP1 stage 1 {other_dp:.2e} from the run saved")
    assert same_dp <= RESUME_TOL and other_dp <= RESUME_TOL_DP

    # consolidate joins the slices into the state dict the live run had at the save.
    whole = consolidate(str(tmp_path), tag="tp2")
    assert _max_error(whole, saved) == 0.0 and all(whole[k].dtype == v.dtype for k, v in saved.items())
    write_safetensors(str(tmp_path), str(tmp_path / "model.safetensors"), tag="tp2")
    from safetensors.torch import load_file

    assert _max_error(load_file(str(tmp_path / "model.safetensors")), saved) == 0.0

    # The manifest: the sizes, each split tensor's attributes, and replicated tensors written once.
    manifest = json.loads((tmp_path / "tp2" / "manifest.json").read_text())
    tp = manifest["tensor_parallel"]
    assert (tp["tp_size"], tp["dp_size"], manifest["world_size"]) == (2, 2, 4)
    assert tp["params"]["blocks.0.up.weight"] == {
        "partition_dim": 0,
        "partition_stride": 1,
        "shape": [FFN, D],
        "slice_shapes": [[FFN // 2, D]] * 2,
        "saved_as": ["blocks.0.up.weight@tp0", "blocks.0.up.weight@tp1"],
    }
    assert tp["params"]["blocks.0.down.weight"]["partition_dim"] == 1
    assert sorted(tp["params"]) == sorted(
        f"blocks.{i}.{m}" for i in range(2) for m in ("up.weight", "up.bias", "down.weight")
    )
    assert manifest["params"]["blocks.0.down.weight"]["shape"] == [D, FFN]
    # Megatron's layout: TP groups [0, 1] [2, 3], so TP rank 0's data-parallel group is ranks 0 and 2. A
    # replicated tensor is written by those only, each TP rank's slices by its own ranks.
    writers: dict[str, set[int]] = {}
    for rank, entries in enumerate(manifest["pieces"]):
        for _, name, _, _ in entries:
            writers.setdefault(name.split("@tp")[-1] if "@tp" in name else "replicated", set()).add(rank)
    assert writers == {"replicated": {0, 2}, "0": {0, 2}, "1": {1, 3}}, writers

    # Another tensor-parallel size: every slice (master and Adam moments) re-cut from the whole tensor.
    # The loaded weights are the saved ones exactly; 3 more steps land where the saved run did, which
    # a lost or mis-cut moment would miss by orders of magnitude (Adam's update is ~lr per element).
    for layout, loaded, resumed in (
        ("TP1xDP4", four["tp1 dp4 loaded"], four["tp1 dp4 resumed"]),
        ("TP4xDP1", four["tp4 dp1 loaded"], four["tp4 dp1 resumed"]),
        ("TP1xDP1", one["loaded"], one["resumed"]),
    ):
        assert _max_error(loaded, saved) == 0.0, layout
        error = _max_error(resumed, reference)
        print(f"3 steps after the load at {layout}: {error:.2e} from the run saved")
        assert error <= RESUME_TOL_DP, (layout, error)
    assert _max_error(two["dense into tp2"], four["dense saved"]) == 0.0  # saved at TP 1, loaded at TP 2


def test_the_rng_trackers_streams_travel_with_the_ranks_rng_states(tmp_path: Path) -> None:
    """Without its tracker state a resumed run would draw other dropout masks inside tensor-parallel
    regions than the run saved; through torch.load(weights_only=True) as a rank file is read."""
    tracker = mpu.get_rng_tracker()
    before = rng_state()
    try:
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, 1234)
        with tracker.fork():
            torch.rand(3)  # the stream has moved on since it was seeded
        torch.save({"rng": rng_state()}, tmp_path / "rank.pt")
        with tracker.fork():
            expected = torch.rand(4)
        tracker.reset()
        set_rng_state(load_file(str(tmp_path / "rank.pt"))["rng"])
        with tracker.fork():
            assert torch.equal(torch.rand(4), expected)
    finally:
        tracker.reset()
        set_rng_state(before)
