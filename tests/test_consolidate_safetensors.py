"""Consolidating into safetensors, streamed from the rank files (engine/checkpoint/consolidate_stream.py):

- a tiny GPT-2 trained by the engine at 2 ranks, saved at stages 1 and 3: one .safetensors file equals the
  engine's own consolidated_state_dict bitwise in fp32 (1 worker and 2), and its bf16 cast with
  --dtype bf16 (the cast of the same fp32 values: round to nearest even either way);
- with a tiny max shard size the output is transformers' shards + model.safetensors.index.json, which
  GPT2LMHeadModel.from_pretrained loads to the same weights; a second run with one shard removes them;
- a DeepSpeed checkpoint directory (tests/data/deepspeed_checkpoints) consolidates to DeepSpeed's own fp32
  masters (reference.pt, which make_fixtures checked equal to DeepSpeed's zero_to_fp32 output) and its
  buffers;
- a truncated rank file is named (the engine's and DeepSpeed's), and no output file is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file

import engine
from engine.checkpoint import CheckpointError
from engine.checkpoint.consolidate import main, write_safetensors, write_safetensors_dir
from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file
from engine.checkpoint.files import load_file as load_checkpoint_file

DS_FIXTURES = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _train_and_save(root: str) -> None:
    for stage in (1, 3):
        torch.manual_seed(0)
        model = _gpt2()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        eng, *_ = engine.initialize(model=model, config=config)
        for step in range(2):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step * 2 + eng.global_rank))
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
        eng.save_checkpoint(f"{root}/stage{stage}", tag="t")
        state = eng.consolidated_state_dict()
        if eng.global_rank == 0:
            torch.save({k: v.clone() for k, v in state.items()}, f"{root}/stage{stage}_reference.pt")
            model.config.save_pretrained(f"{root}/config")
        eng.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("consolidate")
    run_distributed(_train_and_save, world_size=2, args=(str(root),))
    return root


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("stage", [1, 3])
def test_one_file_equals_the_engines_state_dict(saved: Path, tmp_path: Path, stage: int) -> None:
    reference = torch.load(saved / f"stage{stage}_reference.pt", weights_only=True)
    assert "lm_head.weight" in reference  # tied to transformer.wte.weight: written under both names
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.safetensors"
        write_safetensors(str(saved / f"stage{stage}"), str(out), workers=workers)
        _equal(load_file(str(out)), reference)
    out = tmp_path / "bf16.safetensors"
    assert main([str(saved / f"stage{stage}"), str(out), "--dtype", "bf16", "--workers", "2"]) == 0
    _equal(load_file(str(out)), {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in reference.items()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.safetensors", "w1.safetensors", "w2.safetensors"]


def test_shards_load_with_from_pretrained(saved: Path, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    reference = torch.load(saved / "stage3_reference.pt", weights_only=True)
    out = tmp_path / "hf"
    shutil.copytree(saved / "config", out)  # config.json, as save_pretrained writes it
    names = write_safetensors_dir(str(saved / "stage3"), str(out), max_shard_size=20_000, workers=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and names == [*shards, "model.safetensors.index.json"]
    assert sorted(index["weight_map"]) == sorted(reference)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in reference.values())
    for shard in shards:  # each within the limit unless it holds one tensor larger than it
        held = load_file(str(out / shard))
        assert len(held) == 1 or sum(v.numel() * v.element_size() for v in held.values()) <= 20_000, shard
    model = GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    for name, value in reference.items():
        assert torch.equal(state[name], value), name

    # Written again as one file (the default 5GB limit): the earlier shards and index are removed.
    assert write_safetensors_dir(str(saved / "stage3"), str(out), workers=1) == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    _equal(load_file(str(out / "model.safetensors")), reference)


@pytest.mark.parametrize("fixture", ["stage2_bf16", "stage3_fp32"])
def test_a_deepspeed_checkpoint_consolidates_to_its_masters(tmp_path: Path, fixture: str) -> None:
    reference = torch.load(DS_FIXTURES / fixture / "reference.pt", weights_only=True)
    ckpt = DS_FIXTURES / fixture / "ckpt"
    heads = sorted((ckpt / "global_step4").glob("*model_states.pt"))
    module = load_deepspeed_file(str(heads[0]))["module"]
    buffers = {name: module[name] for name in load_deepspeed_file(str(heads[0]))["buffer_names"]}
    assert main([str(ckpt), str(tmp_path / "out") + "/", "--workers", "2"]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    _equal(got, {name: values["master"] for name, values in reference.items()} | buffers)
    # The tag directory itself works too, and one file.
    write_safetensors(str(ckpt / "global_step4"), str(tmp_path / "m.safetensors"), workers=1)
    _equal(load_file(str(tmp_path / "m.safetensors")), got)


def test_a_truncated_rank_file_is_named(saved: Path, tmp_path: Path) -> None:
    for source, victim in [
        (saved / "stage1", "t/rank_1_optim_states.pt"),
        (DS_FIXTURES / "stage2_fp32" / "ckpt", "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ]:
        ckpt = tmp_path / source.parent.name / source.name
        shutil.copytree(source, ckpt)
        path = ckpt / victim
        os.truncate(path, path.stat().st_size // 2)
        out = tmp_path / f"out_{source.parent.name}"
        out.mkdir()
        for write, args, kwargs in (
            (write_safetensors, (str(ckpt), str(out / "m.safetensors")), {"workers": 2}),
            (write_safetensors_dir, (str(ckpt), str(out)), {"max_shard_size": 20_000, "workers": 2}),
        ):
            with pytest.raises(CheckpointError) as err:
                write(*args, **kwargs)
            assert str(path) in str(err.value), str(err.value)
        assert list(out.iterdir()) == []  # no output and no temporary file


def test_a_flipped_byte_is_found_while_copying(saved: Path, tmp_path: Path) -> None:
    # The CRC-32 is taken in the same read that copies the values (one pass over the head of each
    # optimizer file, which holds its pickle and its masters: the manifest's masters_checksums).
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "stage3", ckpt)
    path = ckpt / "t" / "rank_0_optim_states.pt"
    manifest = json.loads((ckpt / "t" / "manifest.json").read_text())
    digest, masters = manifest["checksums"][path.name], manifest["masters_checksums"][path.name]
    assert 0 < masters["offset"] and masters["offset"] + masters["bytes"] < digest["bytes"] // 2  # moments after
    good = path.read_bytes()

    def flip(at: int) -> None:
        data = bytearray(good)
        data[at] ^= 0x10
        path.write_bytes(bytes(data))

    out = tmp_path / "out"
    flip(masters["offset"] + masters["bytes"] // 2)  # a master's value
    for workers in (1, 2):
        with pytest.raises(CheckpointError, match="was modified or damaged after it was saved") as err:
            write_safetensors_dir(str(ckpt), str(out), workers=workers)
        assert str(path) in str(err.value)
        assert list(out.iterdir()) == []
    write_safetensors_dir(str(ckpt), str(out), workers=2, verify=False)  # told not to check: written
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]

    # A moment's byte: not in the output, which is written exactly; loading the file refuses it.
    flip((masters["offset"] + masters["bytes"] + digest["bytes"]) // 2)
    write_safetensors(str(ckpt), str(out / "m.safetensors"), workers=2)
    _equal(load_file(str(out / "m.safetensors")), torch.load(saved / "stage3_reference.pt", weights_only=True))
    with pytest.raises(CheckpointError, match="was modified or damaged after it was saved"):
        load_checkpoint_file(str(path), digest)


def test_masters_must_lie_where_their_checksum_covers_them(saved: Path, tmp_path: Path) -> None:
    # The checked head still ends at the masters' end (so its CRC-32 matches), but claims they start 64
    # bytes earlier: the file's own directory places them elsewhere, and that is refused by name.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "stage1", ckpt)
    manifest = json.loads((ckpt / "t" / "manifest.json").read_text())
    masters = manifest["masters_checksums"]["rank_0_optim_states.pt"]
    masters["offset"], masters["bytes"] = masters["offset"] - 64, masters["bytes"] + 64
    (ckpt / "t" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="its masters are not at bytes") as err:
        write_safetensors(str(ckpt), str(tmp_path / "m.safetensors"), workers=1)
    assert str(ckpt / "t" / "rank_0_optim_states.pt") in str(err.value)
    assert list(tmp_path.glob("m.safetensors*")) == []


def test_a_checkpoint_without_masters_checksums_is_checked_whole(saved: Path, tmp_path: Path) -> None:
    # As saved before masters_checksums: the whole file is read and checked (a moment's byte too).
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "stage1", ckpt)
    manifest = json.loads((ckpt / "t" / "manifest.json").read_text())
    del manifest["masters_checksums"]
    (ckpt / "t" / "manifest.json").write_text(json.dumps(manifest))
    path = ckpt / "t" / "rank_1_optim_states.pt"
    data = bytearray(path.read_bytes())
    data[-len(data) // 4] ^= 0x10  # in the last moment
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="was modified or damaged after it was saved") as err:
        write_safetensors(str(ckpt), str(tmp_path / "m.safetensors"), workers=2)
    assert str(path) in str(err.value)


def test_shard_sizes_and_names_as_transformers_writes_them() -> None:
    from engine.checkpoint.safetensors_writer import TensorSpec, parse_size, shard_names, split_shards

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(7) == 7
    for bad in ("5XB", "-1", 0):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    specs = [TensorSpec(n, torch.float32, (s,)) for n, s in [("a", 10), ("b", 10), ("big", 100), ("c", 5)]]
    runs = split_shards(specs, 80)  # 40 + 40 bytes fill one; the 400-byte tensor gets its own
    assert [[t.name for t in run] for run in runs] == [["a", "b"], ["big"], ["c"]]
    assert split_shards(specs, None) == [specs]
    assert shard_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert shard_names(1) == ["model.safetensors"]


def test_runs_are_copied_from_their_bytes_only_and_a_short_file_is_named(tmp_path: Path) -> None:
    """consolidate_copy.scan_file without a checksum (DeepSpeed's files, verify=False): each run's bytes,
    read in blocks, land at their place, cast or not, across block boundaries; a file that ends inside a
    run is a CheckpointError naming it."""
    from engine.checkpoint import consolidate_copy as cc

    values = torch.randn(3 * cc.SCAN_BYTES // 4 + 123)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(values.numpy().tobytes())
    dst.write_bytes(bytes(4 * values.numel()))
    runs = [  # out of order, one crossing two block boundaries, one cast to bf16, two touching
        cc.Copy("a", str(src), 4 * 1000, str(dst), 0, cc.SCAN_BYTES // 2, torch.float32, torch.float32),
        cc.Copy("b", str(src), 0, str(dst), 2 * cc.SCAN_BYTES, 1000, torch.float32, torch.float32),
        cc.Copy(
            "c",
            str(src),
            4 * 1000 + 2 * cc.SCAN_BYTES,
            str(dst),
            2 * cc.SCAN_BYTES + 4000,
            999,
            torch.float32,
            torch.bfloat16,
        ),
    ]
    tasks = cc.tasks(runs)
    assert [path for path, _ in tasks] == [str(src)] and tasks[0][1][1] is None
    cc.init_worker()
    try:
        path, _, copied = cc.scan_file(tasks[0])
    finally:
        cc.close_files()
    assert path == str(src) and copied == sum(r.numel * 4 for r in runs)
    out = dst.read_bytes()
    got = torch.frombuffer(bytearray(out[: 2 * cc.SCAN_BYTES]), dtype=torch.float32)
    assert torch.equal(got, values[1000 : 1000 + cc.SCAN_BYTES // 2])
    tail = torch.frombuffer(bytearray(out[2 * cc.SCAN_BYTES : 2 * cc.SCAN_BYTES + 4000]), dtype=torch.float32)
    assert torch.equal(tail, values[:1000])
    cast = torch.frombuffer(bytearray(out[2 * cc.SCAN_BYTES + 4000 :][: 2 * 999]), dtype=torch.bfloat16)
    start = 1000 + cc.SCAN_BYTES // 2
    assert torch.equal(cast, values[start : start + 999].to(torch.bfloat16))

    os.truncate(src, 4 * 1000 + cc.SCAN_BYTES)  # ends inside run "a"
    with pytest.raises(CheckpointError, match=f"{src} cannot be read .*the file ends at byte"):
        cc.scan_file(cc.tasks(runs[:1])[0])
    cc.close_files()
