"""engine.load_checkpoint on checkpoints written by real DeepSpeed 0.19.8 (tests/data/deepspeed_checkpoints,
made by make_fixtures.py there: 2 ranks, stages 0-3, fp32 / bf16 / fp16, torch's AdamW and DeepSpeed's
FusedAdam, saved after 4 steps).

- Every fixture resumes at 2 ranks: the fp32 masters and Adam moments each rank holds equal, bitwise,
  DeepSpeed's own full values at the save (its safe_get_full_fp32_param / safe_get_full_optimizer_state,
  which make_fixtures checked against zero_to_fp32's output); the step counters, LR schedule and loss
  scale continue; the next 10 losses equal those of DeepSpeed's own resumed run.
- Two fixtures also resume at 1 and at 4 ranks (another data-parallel size, the same global batch).
- Bad input is refused by name: a truncated file, a missing rank's file, another model's checkpoint (the
  first mismatched parameter and both shapes), and a pickle that would run code (nothing runs).

Loss tolerances (measured on this machine: at 2 ranks fp32 and bf16 are bitwise equal to DeepSpeed's):
fp32 rtol 1e-5 (at 1 and 4 ranks the gradient sums run in another order: measured <= 1.5e-7). bf16 rtol
2e-3 (at 1 and 4 ranks the bf16 gradients are reduced over another number of ranks, each rounding
2^-8 relative: measured <= 5.2e-4). fp16 rtol 2e-3, against DeepSpeed's resumed run with its fp16
loss-scale bugs corrected (make_fixtures.py's BUG_FIXES; expected.json's resumed_losses_bugs_fixed):
- stages 1-3 (DeepSpeedZeroOptimizer.step, DeepSpeedZeroOptimizer_Stage3.step) and stage 0
  (FP16_UnfusedOptimizer.step) grow the loss scale before they unscale, so at each growth the gradients are divided by the new scale, half the one
  they were made with;
- at stage 0 engine.backward() scales the loss only for ZeRO optimizers, so under FP16_UnfusedOptimizer
  the loss is never scaled while step() still divides the gradients by the scale.
DeepSpeed's shipped runs drift from the engine by 1.8% (stages 1-3) and 9.5% (stage 0) by the 10th
resumed step; with the bugs corrected the engine's losses equal DeepSpeed's bitwise at 2 ranks and within
8.7e-5 at 1 and 4 ranks (measured on an AMD EPYC; the rtol leaves room for CPUs whose fp16 kernels round
otherwise). The first resumed loss, which only the loaded state decides, equals the shipped run's too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from distributed import run_distributed

import engine
from engine.checkpoint import CheckpointError
from engine.checkpoint.deepspeed_format import open_reader
from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file

HERE = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"
FIXTURES = sorted(p.name for p in HERE.iterdir() if (p / "expected.json").is_file())
RTOL = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}


def load_script(path: Path) -> ModuleType:
    """A fixture-making script as a module, for its model and data (it imports DeepSpeed only inside
    its own functions)."""
    spec = importlib.util.spec_from_file_location(f"ds_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fixture_module() -> ModuleType:
    """make_fixtures.py's model and data."""
    return load_script(HERE / "make_fixtures.py")


def _config(expected: dict[str, Any], world: int) -> dict[str, Any]:
    """DeepSpeed's config of the fixture, at this world size (the same global batch of 8 rows)."""
    config = json.loads(json.dumps(expected["config"]))
    config["train_micro_batch_size_per_gpu"] = config["train_batch_size"] // world
    return config


def _check_state(eng: Any, reference: dict[str, dict[str, torch.Tensor]]) -> int:
    """Every master piece this rank holds, and its Adam moments, against DeepSpeed's full values; the
    number of elements compared (of the pieces this rank would save: each element counts once)."""
    state = eng._training_state()
    compared = 0
    for record in state.stage.checkpoint_shards():
        if record.opt_group is None:
            continue
        flat = record.tensor.detach().reshape(-1)
        opt_state = eng.basic_optimizer.state[record.tensor]
        for piece in record.pieces:
            window = slice(piece.tensor_offset, piece.tensor_offset + piece.numel)
            saved = slice(piece.param_offset, piece.param_offset + piece.numel)
            for key, ours in (
                ("master", flat),
                ("exp_avg", opt_state["exp_avg"].reshape(-1)),
                ("exp_avg_sq", opt_state["exp_avg_sq"].reshape(-1)),
            ):
                if not torch.equal(ours[window], reference[piece.name][key].reshape(-1)[saved]):
                    raise AssertionError(f"{piece.name} {key} [{saved.start}, {saved.stop}) differs from DeepSpeed's")
            compared += piece.numel if record.write else 0  # replicated (stage 0): one rank counts
    return compared


def _resume_all(names: list[str]) -> dict[str, dict[str, Any]]:
    """On every rank: each fixture loaded into a fresh engine, checked, and trained 10 more steps."""
    import torch.distributed as dist

    fixtures = _fixture_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        expected = json.loads((HERE / name / "expected.json").read_text())
        reference = torch.load(HERE / name / "reference.pt", weights_only=True)
        model = fixtures.make_model(seed=99)
        eng, _, _, scheduler = engine.initialize(model=model, config=_config(expected, world))
        path, client = eng.load_checkpoint(str(HERE / name / "ckpt"))
        compared = _check_state(eng, reference)
        counted = torch.tensor([compared])
        dist.all_reduce(counted)
        resumed = {
            "path": path,
            "client": {k: client[k] for k in ("epoch", "note")},
            "steps": eng.global_steps,
            "samples": eng.global_samples,
            "lr": scheduler.get_last_lr()[0],
            "compared": int(counted),
            "scale": eng.precision.scaler.state_dict() if eng.precision.scaler is not None else None,
        }
        dtype = fixtures.model_dtype(expected["precision"])
        losses = []
        for k in range(len(expected["resumed_losses"])):
            x, y = fixtures.rank_batch(expected["global_steps"] - len(expected["resumed_losses"]) + k, rank, world)
            loss = torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y)
            eng.backward(loss)
            eng.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        resumed["losses"] = losses
        eng.destroy()
        out[name] = resumed
    return out


def _check_resumed(name: str, got: dict[str, Any]) -> None:
    expected = json.loads((HERE / name / "expected.json").read_text())
    total = sum(t["master"].numel() for t in torch.load(HERE / name / "reference.pt", weights_only=True).values())
    assert got["path"] == str(HERE / name / "ckpt" / "global_step4")
    assert got["client"] == {"epoch": 3, "note": name}
    assert (got["steps"], got["samples"]) == (4, 32)
    assert got["compared"] == total  # every element of every master was held by exactly one rank
    # WarmupLR at iteration 3 of 6 (log warmup): DeepSpeed's lr at the save (its param_groups say so)
    assert got["lr"] == pytest.approx(0.01 * torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(6.0)).item())
    if expected["precision"] == "fp16":  # DeepSpeed's scaler had grown 256 -> 512 in 4 steps
        assert got["scale"] == {
            "dynamic": True,
            "scale": 512.0,
            "iterations": 4,
            "skipped_steps": 0,
            "last_overflow_iter": -1,
            "hysteresis_left": 2,
        }
        assert got["losses"][0] == pytest.approx(expected["resumed_losses"][0], rel=1e-6)
    key = "resumed_losses_bugs_fixed" if expected["precision"] == "fp16" else "resumed_losses"
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(expected[key]), rtol=RTOL[expected["precision"]], atol=0
    )


def test_every_fixture_resumes_at_2_ranks() -> None:
    assert len(FIXTURES) == 14, FIXTURES
    results = run_distributed(_resume_all, world_size=2, args=(FIXTURES,), timeout=240)
    for name in FIXTURES:
        assert results[0][name]["losses"] == results[1][name]["losses"]
        _check_resumed(name, results[0][name])


@pytest.mark.parametrize("world", [1, 4])
def test_every_fixture_resumes_at_another_data_parallel_size(world: int) -> None:
    results = run_distributed(_resume_all, world_size=world, args=(FIXTURES,), timeout=240)
    for name in FIXTURES:
        _check_resumed(name, results[0][name])


# ------------------------------------------------------------------------------------- bad input
def _copy(name: str, tmp_path: Path) -> Path:
    """A writable copy of a fixture's checkpoint folder; its tag directory returned."""
    shutil.copytree(HERE / name / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt" / "global_step4"


def _tiny() -> torch.nn.Module:
    return _fixture_module().make_model(seed=0)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    tag = _copy("stage2_fp32", tmp_path)
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match=f"{victim}.*truncated or corrupted"):
        open_reader(str(tag), _tiny())


def test_stage0_fused_groups_that_are_not_the_modules_parameters_in_order_are_refused(tmp_path: Path) -> None:
    """DeepSpeed's fused FP16_Optimizer (stage0_fp16_fusedadam) keeps one flat fp32 master per param
    group with no record of its parameters; the engine reads the groups as the module's parameters in
    order. Flats cut elsewhere (here: the one group split 5 elements into the second parameter) are
    refused naming the parameter, not read shifted."""
    tag = _copy("stage0_fp16_fusedadam", tmp_path)
    path = tag / "mp_rank_00_model_states.pt"
    data = load_deepspeed_file(str(path))
    (flat,) = data["optimizer"]["fp32_groups_flat"]
    first = _tiny().inp.weight.numel()
    data["optimizer"]["fp32_groups_flat"] = [flat[: first + 5].clone(), flat[first + 5 :].clone()]
    torch.save(data, tmp_path / "relaid.pt")  # not over `path`: its old bytes are mapped in `data`
    os.replace(tmp_path / "relaid.pt", path)
    with pytest.raises(CheckpointError, match=r"parameter 'inp.bias' crosses the end of DeepSpeed's flat fp32 group 0"):
        open_reader(str(tag), _tiny())


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    tag = _copy("stage3_bf16", tmp_path)
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match="optimizer states of data-parallel rank 1 .*bf16_zero_pp_rank_1_mp_rank_00"
        "_optim_states.pt.* are missing; DeepSpeed saved this checkpoint at 2",
    ):
        open_reader(str(tag), _tiny())


def test_another_models_checkpoint_names_the_parameter_and_both_shapes() -> None:
    other = _tiny()
    other.mid = torch.nn.Linear(23, 20)  # type: ignore[assignment]
    for name in ("stage0_fp32", "stage2_fp32", "stage3_fp32"):
        with pytest.raises(
            CheckpointError,
            match=r"another model: parameter 'mid.weight' has shape \[19, 23\] there and "
            r"\[20, 23\] here",
        ):
            open_reader(str(HERE / name / "ckpt" / "global_step4"), other)


class _RunsCode:
    """Pickles as a call of os.system: what a malicious checkpoint file holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    tag = _copy("stage2_fp32", tmp_path)
    marker = tmp_path / "it_ran"
    victim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCode(marker)}}, victim)
    with pytest.raises(CheckpointError, match=f"{victim} holds an object .*system.*nothing in it was run"):
        open_reader(str(tag), _tiny())
    assert not marker.exists()


def test_the_deepspeed_objects_become_plain_data() -> None:
    """DeepSpeed's LossScaler, ZeroStageEnum and fragment_address load as stand-ins, with weights_only."""
    data = load_deepspeed_file(
        str(HERE / "stage2_fp16" / "ckpt" / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )["optimizer_state_dict"]
    assert data["zero_stage"] == 2 and type(data["zero_stage"]) is int
    assert data["loss_scaler"].state["cur_scale"] == 512.0 and data["loss_scaler"].state["cur_iter"] == 4
    assert data["param_slice_mappings"][0]["out.bias"].state == {"numel": 5, "start": 433}
