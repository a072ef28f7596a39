"""DeepSpeed's zero_to_fp32 functions and save_checkpoint(exclude_frozen_parameters=) over the engine's own
checkpoints, saved at 2 ranks at stages 2 and 3 from a model whose last layer is frozen:

- get_fp32_state_dict_from_zero_checkpoint is the engine's consolidated state dict (fp32 masters), the
  frozen layer left out with exclude_frozen_parameters=True;
- the files DeepSpeed tools open themselves answer as DeepSpeed's do (Lightning's
  convert_zero_checkpoint_to_fp32_state_dict: `torch.load(get_optim_files(d)[0])["optimizer_state_dict"]
  ["zero_stage"]`, and the client state's keys at the top level of get_model_state_file(d, stage));
- save_checkpoint(exclude_frozen_parameters=True) writes no frozen values: a strict load refuses, saying
  why; load_module_strict=False keeps the model's own frozen values and loads the rest (DeepSpeed's
  semantics);
- load_state_dict_from_zero_checkpoint and convert_zero_checkpoint_to_fp32_state_dict (one file, and
  shards with an index, torch and safetensors) give the same tensors;
- a DeepSpeed checkpoint directory consolidates to DeepSpeed's fp32 masters; the returned optimizer is a
  DeepSpeedOptimizer;
- on DeepSpeed's own directories (tests/data/deepspeed_checkpoints, stages 0-3) get_optim_files,
  get_model_state_files and get_model_state_file name DeepSpeed's files as DeepSpeed's do: a glob in natural
  order (rank 2 before rank 10, checked on 12 ranks' names), FileNotFoundError where there are none (an
  empty directory, stage 0's optimizer files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from torch import nn

import engine
from engine.checkpoint import CheckpointError
from engine.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_checkpoint_files,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_model_state_files,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
)
from engine.runtime.zero_optimizer import DeepSpeedOptimizer

FROZEN = {"2.weight", "2.bias"}


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    model[2].requires_grad_(False)
    return model


def make_engine(stage: int, seed: int) -> tuple[Any, Any]:
    model = build(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    eng, opt, _, _ = engine.initialize(model=model, optimizer=optimizer, config=config)
    return eng, opt


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {k: v.tolist() for k, v in state.items()}


def _save_and_reload(root: str) -> dict[int, dict[str, Any]]:
    results = {}
    for stage in (2, 3):
        save_dir = f"{root}/stage{stage}"
        eng, opt = make_engine(stage, seed=0)
        for step in range(2):
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(step * 2 + torch.distributed.get_rank()))
            eng.backward(eng(x).pow(2).mean())
            eng.step()
        reference = eng.consolidated_state_dict()
        eng.save_checkpoint(save_dir, tag="all", client_state={"epoch": 3, "note": "kept"})
        eng.save_checkpoint(save_dir, tag="trainable", client_state={"epoch": 3}, exclude_frozen_parameters=True)
        eng.destroy()

        fresh, _ = make_engine(stage, seed=1)  # other values everywhere, the frozen layer included
        own = fresh.consolidated_state_dict()
        try:
            fresh.load_checkpoint(save_dir, tag="trainable")
            strict = "loaded"
        except CheckpointError as err:
            strict = str(err)
        fresh.load_checkpoint(save_dir, tag="trainable", load_module_strict=False)
        loaded = fresh.consolidated_state_dict()
        fresh.destroy()
        results[stage] = {
            "reference": _cpu(reference),
            "own": _cpu(own),
            "loaded": _cpu(loaded),
            "strict": strict,
            "is_deepspeed_optimizer": isinstance(opt, DeepSpeedOptimizer),
        }
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("zero_to_fp32")
    return root, run_distributed(_save_and_reload, world_size=2, args=(str(root),))[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_exclude_frozen_parameters(saved: tuple[Path, dict[int, dict[str, Any]]], stage: int) -> None:
    root, results = saved
    got = results[stage]
    assert got["is_deepspeed_optimizer"]
    assert "saved with exclude_frozen_parameters=True" in got["strict"] and "load_module_strict=False" in got["strict"]
    for name, value in got["loaded"].items():
        want = got["own"] if name in FROZEN else got["reference"]
        assert value == want[name], name
    assert got["own"]["2.weight"] != got["reference"]["2.weight"]  # the kept frozen values are the fresh model's
    trainable = get_fp32_state_dict_from_zero_checkpoint(str(root / f"stage{stage}"), tag="trainable")
    assert set(trainable) == set(got["reference"]) - FROZEN


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_and_the_files_deepspeed_tools_read(
    saved: tuple[Path, dict[int, dict[str, Any]]], stage: int
) -> None:
    root, results = saved
    reference = {k: torch.tensor(v) for k, v in results[stage]["reference"].items()}
    ckpt = str(root / f"stage{stage}")
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="all")
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    assert (
        set(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="all", exclude_frozen_parameters=True))
        == set(reference) - FROZEN
    )

    tag_dir = str(root / f"stage{stage}" / "all")
    optim_files = get_optim_files(tag_dir)
    assert [Path(f).name for f in optim_files] == ["rank_0_optim_states.pt", "rank_1_optim_states.pt"]
    zero_stage = torch.load(optim_files[0], weights_only=False)["optimizer_state_dict"]["zero_stage"]
    assert zero_stage == stage
    top = torch.load(get_model_state_file(tag_dir, zero_stage), weights_only=False)
    assert (top["epoch"], top["note"]) == (3, "kept")

    model = load_state_dict_from_zero_checkpoint(build(seed=5), ckpt, tag="all")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)


def test_convert_to_files(saved: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root, results = saved
    reference = {k: torch.tensor(v) for k, v in results[3]["reference"].items()}
    ckpt = str(root / "stage3")
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(tmp_path / "one"), tag="all")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["pytorch_model.bin"]
    torch.testing.assert_close(torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True), reference)

    convert_zero_checkpoint_to_fp32_state_dict(
        ckpt, str(tmp_path / "shards"), max_shard_size=200, safe_serialization=True, tag="all"
    )
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(index["weight_map"]) == sorted(reference)
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        merged.update(load_file(str(tmp_path / "shards" / name)))
    torch.testing.assert_close(merged, reference)


def test_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    # DeepSpeed's own directory (tests/data/deepspeed_checkpoints): its fp32 masters, as its zero_to_fp32 gives them.
    fixture = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints" / "stage3_bf16"
    reference = torch.load(fixture / "reference.pt", weights_only=True)
    state = get_fp32_state_dict_from_zero_checkpoint(str(fixture / "ckpt"))
    assert set(state) == set(reference) | {"scale"}  # and the buffer
    for name, values in reference.items():
        assert torch.equal(state[name], values["master"]), name
    convert_zero_checkpoint_to_fp32_state_dict(str(fixture / "ckpt"), str(tmp_path / "st"), safe_serialization=True)
    torch.testing.assert_close(load_file(str(tmp_path / "st" / "model.safetensors")), state, rtol=0, atol=0)

    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt cannot be read"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


DEEPSPEED_FIXTURES = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


@pytest.mark.parametrize(
    ("fixture", "optim", "model"),
    [
        ("stage1_fp32", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"], 0),
        (
            "stage2_bf16",
            ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"],
            0,
        ),
        ("stage3_fp32", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"], 2),
    ],
)
def test_the_files_of_a_deepspeed_checkpoint(fixture: str, optim: list[str], model: int) -> None:
    """What DeepSpeed's zero_to_fp32 lists in these directories, and Lightning's path through them: the stage
    from the first optimizer file, then that stage's model-state file."""
    from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file

    tag_dir = DEEPSPEED_FIXTURES / fixture / "ckpt" / "global_step4"
    models = (
        ["mp_rank_00_model_states.pt"]
        if model == 0
        else ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    )
    assert get_optim_files(str(tag_dir)) == [str(tag_dir / name) for name in optim]
    assert get_model_state_files(str(tag_dir)) == [str(tag_dir / name) for name in models]
    zero_stage = load_deepspeed_file(get_optim_files(str(tag_dir))[0])["optimizer_state_dict"]["zero_stage"]
    assert zero_stage == int(fixture[5])
    assert get_model_state_file(str(tag_dir), zero_stage) == str(tag_dir / models[0])
    with pytest.raises(FileNotFoundError, match="can't find model states file at .*zero_pp_rank_0_mp_rank_00"):
        get_model_state_file(str(DEEPSPEED_FIXTURES / "stage2_fp32" / "ckpt" / "global_step4"), 3)


def test_deepspeed_files_in_natural_order_and_none_is_an_error(tmp_path: Path) -> None:
    stage0 = DEEPSPEED_FIXTURES / "stage0_fp32" / "ckpt" / "global_step4"
    with pytest.raises(FileNotFoundError, match=r"can't find \*_optim_states.pt files in directory"):
        get_optim_files(str(stage0))  # stage 0 keeps the optimizer in the model-state file, as in DeepSpeed
    assert get_model_state_file(str(stage0), 0) == str(stage0 / "mp_rank_00_model_states.pt")

    ranks = 12
    for rank in reversed(range(ranks)):
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("not a rank file")
    want = [str(tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for rank in range(ranks)]
    assert get_optim_files(str(tmp_path)) == want  # 0, 1, 2, ..., 10, 11: not sorted as text (0, 1, 10, 11, 2)
    assert get_model_state_files(str(tmp_path)) == [name.replace("optim", "model") for name in want]
    assert get_checkpoint_files(str(tmp_path), "zero_pp_rank_1*_optim_states.pt") == [want[1], want[10], want[11]]

    (tmp_path / "empty").mkdir()
    for listing in (get_optim_files, get_model_state_files):
        with pytest.raises(FileNotFoundError, match="in directory '.*empty'.*pass <save_dir>/<tag>"):
            listing(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_model_state_file(str(tmp_path / "missing"), 2)
