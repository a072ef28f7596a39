"""What a checkpoint holds is what loads: client_state checked at save (converted or refused by key
path, on every rank, nothing written), flipped bytes found by the manifest's checksums (at load and in
consolidate), hand-edited manifests and `latest` files refused by name, interrupted saves' .partial
folders removed by the next save, and consolidate resolving tags exactly as load does."""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_distributed
from test_checkpoint import make_engine, train

from engine.checkpoint import CheckpointError
from engine.checkpoint.client_state import prepare_client_state


# ------------------------------------------------------------------------------ client_state
def _save_client_state(save_dir: str, client_state: dict[str, Any]) -> dict[str, Any]:
    eng = make_engine(2)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="first")
    try:
        eng.save_checkpoint(save_dir, tag="second", client_state=client_state)
        saved = "saved"
    except CheckpointError as err:
        saved = str(err)
    fresh = make_engine(2)
    path, loaded = fresh.load_checkpoint(save_dir)
    eng.destroy()
    fresh.destroy()
    return {"saved": saved, "path": path, "loaded": _plain(loaded)}


def _plain(value: Any) -> Any:
    """Tensors as (dtype, values) so the result crosses back to the test process by pickle (a uint32
    tensor read from a memory-mapped file does not)."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


CONVERTED = {
    "best": (np.float64(1.5), 1.5),
    "step": (np.int64(7), 7),
    "flag": (np.bool_(True), True),
    "hist": (np.arange(4, dtype=np.float32), torch.arange(4, dtype=torch.float32)),
    "where": (Path("/runs/a"), "/runs/a"),
    "counts": (defaultdict(int, {"a": 2}), {"a": 2}),
    "ordered": (OrderedDict(b=1), {"b": 1}),
    "nested": ({"xs": [np.float32(0.5), (Path("p"), np.int8(3))]}, {"xs": [0.5, ("p", 3)]}),
    "numpy_rng": (np.random.RandomState(0).get_state(), None),  # the tuple np.random.get_state() gives
    "python_rng": (__import__("random").Random(0).getstate(), None),
}


def test_client_state_that_saves_loads_with_lossless_conversions(tmp_path: Path) -> None:
    state = {k: v for k, (v, _) in CONVERTED.items()}
    for rank, out in enumerate(run_distributed(_save_client_state, 2, args=(str(tmp_path), state))):
        assert out["saved"] == "saved", (rank, out["saved"])
        assert out["path"].endswith("second")
        loaded = out["loaded"]
        for key, (_, want) in CONVERTED.items():
            if want is None:
                continue
            if torch.is_tensor(want):
                assert loaded[key] == _plain(want), key
            else:
                assert loaded[key] == want and type(loaded[key]) is type(want), (key, loaded[key])
        kind, keys, pos, *_ = loaded["numpy_rng"]
        assert kind == "MT19937" and keys == _plain(torch.from_numpy(CONVERTED["numpy_rng"][0][1])) and pos == 624
        assert loaded["python_rng"] == CONVERTED["python_rng"][0]


@pytest.mark.parametrize(("value", "path", "hint"), [
    (argparse.Namespace(lr=0.1), "client_state['args']", "vars(args)"),
    (datetime.datetime(2026, 1, 1), "client_state['args']", "isoformat()"),
    ({"inner": [1, object()]}, "client_state['args']['inner'][1]", "builtins.object"),
    (np.array(["a", "b"]), "client_state['args']", "numpy.ndarray"),
])
def test_client_state_that_would_not_load_is_refused_by_key_path(value: Any, path: str, hint: str) -> None:
    with pytest.raises(CheckpointError) as err:
        prepare_client_state({"args": value})
    assert f"{path} is a " in str(err.value) and hint in str(err.value) and "Nothing was written" in str(err.value)


def test_a_refused_client_state_writes_nothing_on_any_rank(tmp_path: Path) -> None:
    results = run_distributed(_save_client_state, 2, args=(str(tmp_path), {"args": argparse.Namespace(lr=0.1)}))
    for out in results:
        assert "client_state['args'] is a argparse.Namespace" in out["saved"]
        assert out["path"].endswith("first")  # latest untouched, the earlier checkpoint loads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "latest"]


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
    done = subprocess.run([sys.executable, "-m", "engine.checkpoint.consolidate", str(damaged), str(tmp_path / "m.pt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and f"{target} was modified or damaged" in done.stderr, done.stderr
    assert not (tmp_path / "m.pt").exists()


def _edit(manifest: dict[str, Any], how: str) -> None:
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


@pytest.mark.parametrize(("how", "said"), [
    ("missing key", "key (top level): 'pieces' is a required property"),
    ("wrong type", "key world_size: 'two' is not of type 'integer'"),
    ("bad piece", "key pieces.0.0.2: -5 is less than the minimum of 0"),
    ("rank count", "'pieces' lists 1 ranks but world_size is 2"),
    ("checksum type", "key checksums.rank_0_model_states.pt.crc32: 'abc' is not of type 'integer'"),
])
def test_hand_edited_manifests_are_refused_by_key(saved: Path, tmp_path: Path, how: str, said: str) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    manifest_path = edited / "t" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    _edit(manifest, how)
    manifest_path.write_text(json.dumps(manifest))
    for message in run_distributed(_load_message, 2, args=(str(edited),)):
        assert message.startswith(f"{manifest_path}: ") and said in message, message
        assert "load another tag" in message


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
    done = subprocess.run([sys.executable, "-m", "engine.checkpoint.consolidate", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert ".t.old is complete" in done.stderr
    assert torch.load(out, weights_only=True).keys()
