"""client_state that saves also loads, as the types that were saved: what Megatron-style scripts keep
there (an args Namespace, numpy's and Python's RNG states, numpy numbers) comes back as the same
types at 2 ranks; what torch.load(weights_only=True) would refuse is refused at save by key path on
every rank, nothing written; an older checkpoint whose client_state cannot be read names its file."""

from __future__ import annotations

import argparse
import datetime
import json
import random
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_distributed
from test_checkpoint import make_engine, train

from engine.checkpoint import CheckpointError
from engine.checkpoint.client_state import ENCODED, prepare_client_state, restore_client_state


def _save_and_load(save_dir: str, client_state: dict[str, Any], bad_on_rank: int | None = None) -> dict[str, Any]:
    """Save tag `first` (no client_state), then `second` with client_state (on `bad_on_rank`, with a
    value no checkpoint can hold); load whatever `latest` names into a fresh engine."""
    rank = torch.distributed.get_rank()
    eng = make_engine(2)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="first")
    if rank == bad_on_rank:
        client_state = {**client_state, "tokenizer": object()}
    try:
        eng.save_checkpoint(save_dir, tag="second", client_state=client_state)
        saved = "saved"
    except CheckpointError as err:
        saved = str(err)
    fresh = make_engine(2)
    path, loaded = fresh.load_checkpoint(save_dir)
    eng.destroy()
    fresh.destroy()
    return {"saved": saved, "path": path, "loaded": _sendable(loaded)}


def _sendable(value: Any) -> Any:
    """Tensors as ("tensor", dtype, values): a tensor read from a memory-mapped file does not cross back
    to the test process by pickle. Everything else as it is, types included."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**{k: _sendable(v) for k, v in vars(value).items()})
    if isinstance(value, dict):
        return type(value)({k: _sendable(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_sendable(v) for v in value)
    return value


def _megatron_style_state() -> dict[str, Any]:
    """What Megatron-DeepSpeed's save_checkpoint hands DeepSpeed as client_state, and then some."""
    return {
        "args": argparse.Namespace(
            lr=1e-4,
            num_layers=4,
            tokenizer_type="GPT2BPETokenizer",
            save=Path("/runs/a"),
            seed=np.int64(1234),
            rampup=None,
        ),
        "iteration": 7,
        "checkpoint_version": 3.0,
        "rng_state": [
            {
                "random_rng_state": random.Random(0).getstate(),
                "np_rng_state": np.random.RandomState(0).get_state(),
                "torch_rng_state": torch.Generator().manual_seed(0).get_state(),
            }
        ],
        "best": np.float64(1.5),
        "loss_scale": np.float32(0.1),
        "flag": np.bool_(True),
        "hist": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ema": torch.arange(6.0).reshape(2, 3),
        "counts": defaultdict(int, {"a": 2}),
        "ordered": OrderedDict(b=1, a=2),
        "seen": Counter("aab"),
    }


def test_what_megatron_style_scripts_save_loads_back_as_the_same_types(tmp_path: Path) -> None:
    want = _megatron_style_state()
    for rank, out in enumerate(run_distributed(_save_and_load, 2, args=(str(tmp_path), want))):
        assert out["saved"] == "saved", (rank, out["saved"])
        assert out["path"].endswith("second")
        got = out["loaded"]
        args = got["args"]
        assert type(args) is argparse.Namespace
        assert vars(args) == {
            "lr": 1e-4,
            "num_layers": 4,
            "tokenizer_type": "GPT2BPETokenizer",
            "save": "/runs/a",
            "seed": 1234,
            "rampup": None,
        }
        assert type(args.seed) is np.int64
        assert got["iteration"] == 7 and got["checkpoint_version"] == 3.0
        rng = got["rng_state"][0]
        # The RNG states resume the same draws: numpy's through np.random.set_state (a uint32 ndarray).
        kind, keys, *_ = rng["np_rng_state"]
        assert kind == "MT19937" and type(keys) is np.ndarray and keys.dtype == np.uint32
        resumed = np.random.RandomState()
        resumed.set_state(rng["np_rng_state"])
        assert resumed.random_sample(4).tolist() == np.random.RandomState(0).random_sample(4).tolist()
        python = random.Random()
        python.setstate(rng["random_rng_state"])
        assert python.random() == random.Random(0).random()
        assert rng["torch_rng_state"] == _sendable(want["rng_state"][0]["torch_rng_state"])
        for key in ("best", "loss_scale", "flag"):
            assert type(got[key]) is type(want[key]) and got[key] == want[key], key
        assert type(got["hist"]) is np.ndarray and got["hist"].dtype == np.float32
        assert got["hist"].tolist() == want["hist"].tolist()
        assert got["ema"] == ("tensor", "torch.float32", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
        assert type(got["counts"]) is dict and got["counts"] == {"a": 2}  # a default_factory is code: not kept
        assert type(got["ordered"]) is OrderedDict and list(got["ordered"].items()) == [("b", 1), ("a", 2)]
        assert type(got["seen"]) is Counter and got["seen"] == Counter("aab")


@pytest.mark.parametrize(
    ("client_state", "said"),
    [
        (
            {"args": argparse.Namespace(lr=0.1, start=datetime.datetime(2026, 1, 1))},
            "client_state['args'].start is a datetime.datetime, which a checkpoint cannot load back",
        ),
        ({"hist": [1.0, 2.0, 3.0, object()]}, "client_state['hist'][3] is a builtins.object"),
        ({"when": datetime.date(2026, 1, 1)}, "client_state['when'] is a datetime.date"),
        ({"names": np.array(["a", None], dtype=object)}, "client_state['names'] is a numpy value of dtype object"),
        ({"rec": np.zeros(2, dtype=[("a", "<i4")])}, "client_state['rec'] is a numpy value of dtype [('a', '<i4')]"),
        ({"x": {ENCODED: "numpy"}}, f"client_state['x'] has the key {ENCODED!r}, which checkpoints reserve"),
        ({"x": {(1, 2): 3}}, "client_state['x'] has a key of type tuple"),
    ],
)
def test_what_would_not_load_is_refused_by_key_path(client_state: dict[str, Any], said: str) -> None:
    with pytest.raises(CheckpointError) as err:
        prepare_client_state(client_state)
    assert said in str(err.value) and "Nothing was written" in str(err.value), str(err.value)


def test_the_hint_says_how_to_store_a_datetime() -> None:
    with pytest.raises(CheckpointError, match=r"store value\.isoformat\(\) or value\.timestamp\(\) instead"):
        prepare_client_state({"started": datetime.datetime(2026, 1, 1)})


def test_a_refusal_on_one_rank_writes_nothing_on_any_rank(tmp_path: Path) -> None:
    results = run_distributed(_save_and_load, 2, args=(str(tmp_path), {"iteration": 7}, 1))
    assert "client_state['tokenizer'] is a builtins.object" in results[1]["saved"]
    assert results[0]["saved"].startswith("save_checkpoint refused on rank 1: ")
    for out in results:
        assert out["path"].endswith("first")  # latest untouched, the earlier checkpoint loads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "latest"]


def _load_message(save_dir: str) -> str:
    eng = make_engine(2)
    try:
        eng.load_checkpoint(save_dir)
        return "loaded"
    except CheckpointError as err:
        return str(err)
    finally:
        eng.destroy()


def _save_plain(save_dir: str) -> None:
    eng = make_engine(2)
    train(eng, range(1))
    eng.save_checkpoint(save_dir, tag="old")
    eng.destroy()


def _rewrite_client_state(ckpt: Path, client_state: dict[str, Any]) -> Path:
    """Rank 0's file with another client_state, as a checkpoint from before checksums (none in the
    manifest) would hold it."""
    head = ckpt / "old" / "rank_0_model_states.pt"
    state = torch.load(head, weights_only=True)
    state["client_state"] = client_state
    torch.save(state, head)
    manifest_path = ckpt / "old" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["checksums"]
    manifest_path.write_text(json.dumps(manifest))
    return head


def test_an_older_checkpoint_whose_client_state_cannot_be_read_names_the_file(tmp_path: Path) -> None:
    run_distributed(_save_plain, 2, args=(str(tmp_path),))
    head = _rewrite_client_state(tmp_path, {"args": argparse.Namespace(lr=0.1)})  # written by torch.save itself
    for message in run_distributed(_load_message, 2, args=(str(tmp_path),)):
        assert message.startswith(f"{head} holds an object that torch.load(weights_only=True) refuses"), message
        assert "argparse.Namespace" in message


def test_an_encoded_value_that_was_edited_names_the_file() -> None:
    edited = {"x": [{ENCODED: "numpy", "dtype": "|O", "shape": [1], "scalar": False, "data": bytes(8)}]}
    with pytest.raises(
        CheckpointError,
        match=r"^ckpt/rank_0_model_states\.pt: client_state\['x'\]\[0\] is an "
        r"encoded value this engine cannot rebuild",
    ):
        restore_client_state(edited, "ckpt/rank_0_model_states.pt")
