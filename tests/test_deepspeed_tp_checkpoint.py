"""A DeepSpeed checkpoint saved with tensor parallelism (AutoTP, TP 2 x DP 1, stage 1, fp32, a tiny
Hugging Face Llama; written by real DeepSpeed 0.19.8: tests/data/deepspeed_tp_checkpoint) resumes on
the engine at the same TP size and at TP 1, at world sizes 1 and 2: the next 10 losses equal
DeepSpeed's own resumed run's within fp32 noise. DeepSpeed split q/k/v/gate/up and lm_head along
dim 0 and o/down along dim 1; its affine_map says so, and the engine re-cuts the slices for its own
layout (engine/checkpoint/deepspeed_format/tensor_parallel.py, engine/checkpoint/tp_recut.py).
The same for a model with fused qkv_proj and gate_up_proj (stage1_fp32_tp2_fused), which DeepSpeed cut
into sub-parameters under its partition_config: each rank holds its share of every part (the engine's
partition_stride), and the engine's AutoTP reads the same partition_config at TP 2. And for the Llama
written by DeepSpeed 0.17.6 (stage1_fp32_tp2_ds0176), which records no affine_map: the split is read
from the shard shapes against the model's. And for a fused qkv of unequal parts (4 query heads, 2
key/value heads: stage1_fp32_tp2_gqa), joined part by part, at TP 1 (the engine's AutoTP splits equal
parts only).

Tolerance: DeepSpeed's and the engine's row-parallel sums and Adam run the same math in other
orders; LOSS_RTOL is far below what a mis-cut slice or a lost moment gives (checked by the last test).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed

HERE = Path(__file__).parent / "data" / "deepspeed_tp_checkpoint"
CASE = HERE / "stage1_fp32_tp2"
FUSED = HERE / "stage1_fp32_tp2_fused"
OLD = HERE / "stage1_fp32_tp2_ds0176"
"""The Llama case written by DeepSpeed 0.17.6: no universal_checkpoint_info, the split read from the shapes."""
GQA = HERE / "stage1_fp32_tp2_gqa"
"""FusedLM with 2 key/value heads for 4 query heads: qkv_proj cut into unequal parts [16; 8; 8]."""
"""The Llama case written by DeepSpeed 0.17.6: no universal_checkpoint_info, the split read from the shapes."""
"""A model with fused qkv_proj and gate_up_proj, which DeepSpeed cut into equal sub-parameters."""
LOSS_RTOL = 1e-5


def _fixture() -> ModuleType:
    from test_deepspeed_checkpoints import load_script

    return load_script(HERE / "make_fixture.py")


def _resume(tp: int, drop_moments: bool = False, case: str = CASE.name) -> dict[str, Any]:
    import engine
    from engine.checkpoint import tp_recut

    fixture = _fixture()
    config = fixture.ds_config(case)
    world = torch.distributed.get_world_size()
    if tp == 1:
        del config["tensor_parallel"]
        config["train_batch_size"] = fixture.MICRO * world
    if drop_moments:  # a mutant: the re-cut loses Adam's moments (the test must see it)
        read = tp_recut.RecutReader.read

        def lossy(self: Any, name: str, kind: str, key: str, lo: int, numel: int, out: torch.Tensor) -> None:
            read(self, name, kind, key, lo, numel, out)
            if key.startswith("exp_avg"):
                out.zero_()

        tp_recut.RecutReader.read = lossy  # type: ignore[method-assign]
    model = fixture.make_model(seed=99, case=case)
    eng, *_ = engine.initialize(model=model, config=config)
    path, client = eng.load_checkpoint(str(HERE / case / "ckpt"))
    losses = []
    rank, dp = eng.parallel.dp_rank, eng.parallel.dp_size
    for k in range(fixture.RESUME_STEPS):
        ids = fixture.batch(fixture.SAVE_AT + k)
        rows = ids[rank * len(ids) // dp : (rank + 1) * len(ids) // dp]  # DeepSpeed's batch, split over DP
        loss = eng(input_ids=rows, labels=rows).loss
        eng.backward(loss)
        eng.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / torch.distributed.get_world_size())
    out = {"path": path, "epoch": client.get("epoch"), "steps": eng.global_steps, "losses": losses}
    eng.destroy()
    return out


def _expected(case: str = CASE.name) -> dict[str, Any]:
    return json.loads((HERE / case / "expected.json").read_text())


RESUMES = [(case.name, world, tp) for case in (CASE, FUSED, OLD) for world, tp in ((2, 2), (2, 1), (1, 1))] + [
    (GQA.name, 2, 1),
    (GQA.name, 1, 1),
]  # the engine splits no layer of unequal parts: TP 1 only


@pytest.mark.parametrize(("case", "world", "tp"), RESUMES)
def test_a_deepspeed_autotp_checkpoint_resumes_at_any_tp_size(case: str, world: int, tp: int) -> None:
    got = run_distributed(_resume, world_size=world, args=(tp, False, case), timeout=240)[0]
    expected = _expected(case)
    assert got["epoch"] == 3 and got["steps"] == expected["global_steps"]
    assert got["losses"] == pytest.approx(expected["resumed_losses"], rel=LOSS_RTOL), (got["losses"], expected)


def test_losing_the_moments_at_the_re_cut_would_be_seen() -> None:
    got = run_distributed(_resume, world_size=1, args=(1, True), timeout=240)[0]
    assert got["losses"] != pytest.approx(_expected()["resumed_losses"], rel=LOSS_RTOL)


def test_a_missing_tensor_parallel_rank_file_is_named(tmp_path: Path) -> None:
    import shutil

    from engine.checkpoint import CheckpointError
    from engine.checkpoint.deepspeed_format import open_reader

    shutil.copytree(CASE / "ckpt", tmp_path / "ckpt")
    tag = tmp_path / "ckpt" / "global_step4"
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"tensor-parallel size 2 .*mp_rank_01_model_states.pt is missing"):
        open_reader(str(tag), _fixture().make_model(seed=0))


@pytest.mark.parametrize(("case", "splits"), [(CASE.name, 15), (FUSED.name, 12), (GQA.name, 12)])
def test_consolidate_joins_deepspeeds_tensor_parallel_slices(tmp_path: Path, case: str, splits: int) -> None:
    """python -m engine.checkpoint.consolidate on the AutoTP checkpoint: the dense model's state dict,
    each split tensor DeepSpeed's own per-rank module weights joined: concatenated, or for a fused layer
    (qkv_proj: 3 parts, unequal in the GQA case; gate_up_proj: 2) each part's pieces concatenated, then
    the parts."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file

    out = tmp_path / "model.safetensors"
    subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(HERE / case / "ckpt"), str(out)], check=True
    )
    whole = load_file(str(out))
    tag = HERE / case / "ckpt" / "global_step4"
    modules = [load_deepspeed_file(str(tag / f"mp_rank_0{m}_model_states.pt"))["module"] for m in range(2)]
    split = 0
    for name, value in whole.items():
        first, second = modules[0][name], modules[1][name]
        if first.shape != value.shape:
            dim = next(d for d in range(value.dim()) if first.shape[d] != value.shape[d])
            rows = first.shape[dim]
            sizes = [rows]  # each rank's share of each part, in order
            if "qkv_proj" in name:
                sizes = [rows // 2, rows // 4, rows // 4] if case == GQA.name else [rows // 3] * 3
            elif "gate_up_proj" in name:
                sizes = [rows // 2] * 2
            pieces = zip(first.split(sizes, dim), second.split(sizes, dim))
            first, split = torch.cat([torch.cat(pair, dim) for pair in pieces], dim), split + 1
        assert torch.equal(first.float(), value.float()), name
    assert split == splits


def test_sub_parameter_layouts_are_read_as_parts_or_refused_by_name() -> None:
    """A fused [q; k; v] with fewer key/value heads (q 16 rows, k and v 8 each) at TP 2: DeepSpeed gives
    each rank 8 + 4 + 4 rows, read as the parts' sizes; equal parts are the engine's stride; pieces in
    any other order are refused, naming the parameter."""
    from engine.checkpoint import CheckpointError
    from engine.checkpoint.deepspeed_format.tensor_parallel import _split_of

    def rank(r: int, parts: list[tuple[int, int]], swap: bool = False) -> dict[str, Any]:
        pieces, dest = [], 0
        for start, rows in parts:
            half = rows // 2
            pieces.append({"shape": [half, 4], "source": [(start + r * half) * 4, [4, 1]], "dest": [dest * 4, [4, 1]]})
            dest += half
        if swap:
            pieces[1]["source"], pieces[2]["source"] = pieces[2]["source"], pieces[1]["source"]
        return {"shard_shape": [dest, 4], "pieces": pieces}

    gqa, equal = [(0, 16), (16, 8), (24, 8)], [(0, 8), (8, 8), (16, 8)]
    tag, name = "ckpt/global_step4", "layers.0.qkv_proj.weight"
    entry = {"logical_shape": [32, 4], "ranks": {"0": rank(0, gqa), "1": rank(1, gqa)}}
    assert _split_of(name, entry, 2, tag) == ([32, 4], 0, 1, [16, 8, 8])
    entry = {"logical_shape": [24, 4], "ranks": {"0": rank(0, equal), "1": rank(1, equal)}}
    assert _split_of(name, entry, 2, tag) == ([24, 4], 0, 3, None)
    entry = {"logical_shape": [32, 4], "ranks": {"0": rank(0, gqa), "1": rank(1, gqa, swap=True)}}
    with pytest.raises(
        CheckpointError, match=r"'layers.0.qkv_proj.weight' .*not each rank's share of consecutive parts"
    ):
        _split_of(name, entry, 2, tag)


def test_a_checkpoint_without_an_affine_map_is_read_from_the_models_shapes_only() -> None:
    """DeepSpeed 0.17.6 wrote no universal_checkpoint_info: how a parameter was split is read from its
    shard shapes against the model's. Without the model (consolidation) that is refused by name, and so
    is a fused qkv, whose layout DeepSpeed < 0.18 chose by model type and did not record."""
    import subprocess
    import sys

    from engine.checkpoint import CheckpointError
    from engine.checkpoint.deepspeed_format.tensor_parallel import _split_from_shapes

    done = subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(OLD / "ckpt"), "/nonexistent/out.safetensors"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "has no universal_checkpoint_info.affine_map" in done.stderr, done.stderr
    assert "load it with engine.load_checkpoint into the model" in done.stderr
    tag = "ckpt/global_step4"
    assert _split_from_shapes("o_proj.weight", [[16, 8], [16, 8]], [16, 16], tag) == ([16, 16], 1, 1, None)
    assert _split_from_shapes("norm.weight", [[16], [16]], [16], tag) == ([16], None, 1, None)
    with pytest.raises(CheckpointError, match=r"'layers.0.self_attn.qkv_proj.weight' as a fused qkv, in a layout"):
        _split_from_shapes("layers.0.self_attn.qkv_proj.weight", [[24, 16], [24, 16]], [48, 16], tag)
    with pytest.raises(CheckpointError, match=r"'up.weight' has shard shapes \[\[16, 16\], \[16, 16\]\] .* \[48, 16\]"):
        _split_from_shapes("up.weight", [[16, 16], [16, 16]], [48, 16], tag)
