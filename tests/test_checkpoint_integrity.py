"""What loads is what was saved: flipped bytes found by the manifest's checksums (at load and in
consolidate), hand-edited manifests and `latest` files refused by name, interrupted saves' .partial
folders removed by the next save, and consolidate resolving tags exactly as load does. (client_state:
test_checkpoint_client_state.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from test_checkpoint import make_engine, train

from engine.checkpoint import CheckpointError
from engine.checkpoint.consolidate import consolidate, write_safetensors


# -------------------------------------------------------------------------- flipped bytes
def _save_two(save_dir: str) -> None:
    eng = make_engine(2)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="t")
    eng.destroy()


def _load_message(save_dir: str, tag: str | None = "t") -> str:
    eng = make_engine(2)
    try:
        eng.load_checkpoint(save_dir, tag=tag)
        return "loaded"
    except CheckpointError as err:
        return str(err)
    finally:
        eng.destroy()


def _flip_inside_a_tensor(path: Path) -> None:
    """Flip bytes in the middle of the file's largest stored tensor: still a valid zip and pickle, so
    only a checksum can tell (without one this loaded weights of 5.7e37)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 8):
        data[i] ^= 0x7F
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    run_distributed(_save_two, 2, args=(str(root / "good"),))
    return root / "good"


def test_flipped_bytes_are_found_at_load_and_in_consolidate(saved: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    target = damaged / "t" / "rank_1_optim_states.pt"
    _flip_inside_a_tensor(target)
    for message in run_distributed(_load_message, 2, args=(str(damaged),)):
        assert f"{target} was modified or damaged after it was saved (CRC-32" in message, message
    done = subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(damaged), str(tmp_path / "m.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and f"{target} was modified or damaged" in done.stderr, done.stderr
    assert not (tmp_path / "m.pt").exists()


def _edit(manifest: dict[str, Any], how: str) -> str:
    """The manifest's text after a hand edit."""
    if how == "missing key":
        del manifest["pieces"]
    elif how == "wrong type":
        manifest["world_size"] = "two"
    elif how == "bad piece":
        manifest["pieces"][0][0][2] = -5
    elif how == "rank count":
        manifest["pieces"].pop()
    elif how == "checksum type":
        manifest["checksums"]["rank_0_model_states.pt"]["crc32"] = "abc"
    elif how == "checksum removed":  # would leave that file unchecked
        del manifest["checksums"]["rank_1_optim_states.pt"]
    elif how == "alias target":
        manifest["aliases"]["out.weight"] = "missing.weight"
    elif how == "shape":
        manifest["params"]["inp.weight"]["shape"] = [3, 3]
    elif how == "bad json":
        return json.dumps(manifest)[:-40]
    return json.dumps(manifest)


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("missing key", "key (top level): 'pieces' is a required property"),
        ("wrong type", "key world_size: 'two' is not of type 'integer'"),
        ("bad piece", "key pieces.0.0.2: -5 is less than the minimum of 0"),
        ("rank count", "key pieces: lists 1 ranks but world_size is 2"),
        ("checksum type", "key checksums.rank_0_model_states.pt.crc32: 'abc' is not of type 'integer'"),
        ("checksum removed", "key checksums: has no entry for rank_1_optim_states.pt"),
        ("alias target", "key aliases.out.weight: names 'missing.weight', which is not in params"),
        ("shape", "key params.inp.weight.shape: [3, 3] holds 9 elements but the pieces listed for 'inp.weight' hold "),
        ("bad json", "not readable JSON (Expecting value: line 1 column "),
    ],
)
def test_hand_edited_manifests_are_refused_by_key(saved: Path, tmp_path: Path, how: str, said: str) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    manifest_path = edited / "t" / "manifest.json"
    manifest_path.write_text(_edit(json.loads(manifest_path.read_text()), how))
    for message in [*run_distributed(_load_message, 2, args=(str(edited),)), _consolidate_message(edited)]:
        assert message.startswith(f"{manifest_path}: ") and said in message, message
        assert "load another tag" in message


def _consolidate_message(ckpt: Path) -> str:
    try:
        consolidate(str(ckpt))
        return "consolidated"
    except CheckpointError as err:
        return str(err)


@pytest.mark.parametrize(
    ("piece", "said"),
    [
        (
            ["model", "ghost", 0, 4],
            ("key pieces.1 lists 'ghost', which is neither in params nor saved whole in rank_1_model_states.pt"),
        ),
        (["model", "calls", 1, 1], "key pieces: 'calls' is listed with 2 elements, its saved shape [] holds 1"),
    ],
)
def test_consolidate_refuses_pieces_its_files_do_not_hold(
    saved: Path, tmp_path: Path, piece: list[Any], said: str
) -> None:
    # Loading reads the pieces of the model's own names; consolidating writes every listed name, with
    # a safetensors header that must fit the data after it.
    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    manifest_path = edited / "t" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["pieces"][1].append(piece)
    manifest_path.write_text(json.dumps(manifest))
    for write in (lambda: consolidate(str(edited)), lambda: write_safetensors(str(edited), str(tmp_path / "m.st"))):
        with pytest.raises(CheckpointError) as err:
            write()
        assert str(err.value).startswith(f"{manifest_path}: ") and said in str(err.value), str(err.value)
    assert not (tmp_path / "m.st").exists()


@pytest.mark.parametrize("latest", ["../../etc", "/etc", "t/../..", "..", ".t.partial"])
def test_latest_may_not_point_outside_the_checkpoint_folder(saved: Path, tmp_path: Path, latest: str) -> None:
    moved = tmp_path / "ckpt"
    shutil.copytree(saved, moved)
    (moved / "latest").write_text(latest)
    for message in run_distributed(_load_message, 2, args=(str(moved), None)):
        assert message.startswith(f"{moved / 'latest'}: tag {latest!r} is not a plain directory name"), message


def _save_after_interrupted(save_dir: str) -> None:
    eng = make_engine(2)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="next")
    eng.destroy()


def test_the_next_save_removes_interrupted_partial_folders(saved: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    for leftover in (".t.partial", ".other.partial"):  # saves killed before their rename
        (ckpt / leftover).mkdir()
        (ckpt / leftover / "rank_0_model_states.pt").write_bytes(b"half")
    run_distributed(_save_after_interrupted, 2, args=(str(ckpt),))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "next", "t"]


def test_consolidate_resolves_tags_as_load_does(saved: Path, tmp_path: Path) -> None:
    # A save over tag t killed between its two renames leaves only .t.old: load and consolidate both use it.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "t").rename(ckpt / ".t.old")
    assert run_distributed(_load_message, 2, args=(str(ckpt), None)) == ["loaded", "loaded"]
    out = tmp_path / "model.pt"
    done = subprocess.run(
        [sys.executable, "-m", "engine.checkpoint.consolidate", str(ckpt), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert ".t.old is complete" in done.stderr
    assert torch.load(out, weights_only=True).keys()
