"""Hostile config inputs: each is a ConfigError naming the key path or the file and the fix, from every
source a config comes from (a file, a dict, a base64 string) and in JSON and hjson syntax."""

from __future__ import annotations

import base64
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import make_model

import engine
from engine.config import ConfigError, EngineConfig, load_config, zero_stage
from engine.config.nesting import MAX_DEPTH

WS_SOURCE = "WORLD_SIZE env (torchrun)"
BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}
INF, NAN = math.inf, math.nan
NOT_FINITE_FIX = "fix: write a finite number"


def load(source: Any) -> EngineConfig:
    return load_config(source, world_size=1, world_size_source=WS_SOURCE)


def refused(source: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load(source)
    return str(info.value)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def sources(tmp_path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The same config as a dict, a JSON file and base64 JSON; json.dumps writes inf/nan as Infinity/NaN."""
    text = json.dumps(config)
    path = tmp_path / "ds.json"
    path.write_text(text)
    return {"dict": config, "file": path, "base64": b64(text)}


def adam(**params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


# --- NaN and Infinity ------------------------------------------------------------------------------

NON_FINITE = [
    pytest.param(adam(lr=INF), "optimizer.params.lr: Infinity", id="lr-inf"),
    pytest.param(adam(lr=NAN), "optimizer.params.lr: NaN", id="lr-nan"),
    pytest.param(adam(lr=-INF), "optimizer.params.lr: -Infinity", id="lr-neg-inf"),
    pytest.param(adam(betas=[0.9, NAN]), "optimizer.params.betas[1]: NaN", id="betas-nan"),
    pytest.param({"gradient_clipping": INF}, "gradient_clipping: Infinity", id="clip-inf"),
    pytest.param({"gradient_clipping": NAN}, "gradient_clipping: NaN", id="clip-nan"),
    pytest.param({"fp16": {"enabled": True, "loss_scale": INF}}, "fp16.loss_scale: Infinity", id="loss-scale"),
    pytest.param(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": NAN}}},
        "scheduler.params.warmup_max_lr: NaN",
        id="scheduler-param",
    ),
    pytest.param(
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": INF}},
        "zero_optimization.reduce_bucket_size: Infinity",
        id="zero-int-key",
    ),
    pytest.param({"steps_per_print": -INF}, "steps_per_print: -Infinity", id="steps-per-print-neg-inf"),
    pytest.param({"steps_per_print": NAN}, "steps_per_print: NaN", id="steps-per-print-nan"),
]


@pytest.mark.parametrize(("extra", "expected"), NON_FINITE)
def test_non_finite_number_is_refused_naming_the_key(tmp_path: Path, extra: dict[str, Any], expected: str) -> None:
    for kind, source in sources(tmp_path, {**BASE, **extra}).items():
        message = refused(source)
        assert f"{expected} is not a finite number" in message, (kind, message)
        assert NOT_FINITE_FIX in message, (kind, message)
        assert "is not of type" not in message, (kind, message)  # one problem per key, not two
        if kind == "file":
            assert str(source) in message


HJSON_TEXT = """\
{
  # hjson: comments, quoteless keys and strings, optional commas, trailing commas
  train_micro_batch_size_per_gpu: 2
  optimizer: {type: "AdamW", params: {lr: Infinity, eps: NaN,},}
  gradient_clipping: -Infinity   // end-of-line form, where hjson would read a quoteless string
  fp16: {
    enabled: true
    loss_scale: NaN
  }
}
"""


def test_non_finite_tokens_in_hjson_syntax(tmp_path: Path) -> None:
    path = tmp_path / "ds.hjson"
    path.write_text(HJSON_TEXT)
    for source in (path, b64(HJSON_TEXT)):
        message = refused(source)
        for expected in (
            "optimizer.params.lr: Infinity",
            "optimizer.params.eps: NaN",
            "gradient_clipping: -Infinity",
            "fp16.loss_scale: NaN",
        ):
            assert f"{expected} is not a finite number" in message, message
        assert "Bad key name" not in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e400}}}',
            "optimizer.params.lr: Infinity",
            id="json-1e400",
        ),
        pytest.param(
            '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": -2.5e999}',
            "gradient_clipping: -Infinity",
            id="json-neg-overflow",
        ),
        pytest.param(
            "{\n  train_micro_batch_size_per_gpu: 2\n  optimizer: {type: 'AdamW', params: {lr: 1e400}}\n}",
            "optimizer.params.lr: Infinity",
            id="hjson-1e400",
        ),
        pytest.param(
            "{\n  train_micro_batch_size_per_gpu: 2\n  gradient_clipping: 1.5e400\n}",
            "gradient_clipping: Infinity",
            id="hjson-eol",
        ),
    ],
)
def test_number_too_large_for_a_float_names_the_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    for source in (path, b64(text)):
        message = refused(source)
        assert f"{expected} is not a finite number" in message and NOT_FINITE_FIX in message, message
        assert "1e400" in message  # the message says why a finite-looking number reads as Infinity


def test_integer_beyond_float_range_in_a_dict_reads_as_infinity_as_in_a_file(tmp_path: Path) -> None:
    # A file's 10**400 literal reads as Infinity; the same int in a dict crashed build's float() with
    # a raw OverflowError. Both now mean the same: refused by key, or a documented meaning.
    for value, spelled in ((10**400, "Infinity"), (-(10**400), "-Infinity")):
        for extra, key in (
            ({"gradient_clipping": value}, "gradient_clipping"),
            (adam(lr=value), "optimizer.params.lr"),
            ({"zero_optimization": {"stage": 2, "reduce_bucket_size": value}}, "zero_optimization.reduce_bucket_size"),
        ):
            config = {**BASE, **extra}
            path = tmp_path / "ds.json"
            path.write_text(json.dumps(config))
            for source in (config, path):
                message = refused(source)
                assert f"{key}: {spelled} is not a finite number" in message and NOT_FINITE_FIX in message, message
    config = {**BASE, "steps_per_print": 10**400}
    assert load(config).steps_per_print is None and config["steps_per_print"] == 10**400
    big = 2**62  # an int a float can hold (if not exactly) stays the int it was
    assert load({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": big}}).zero.reduce_bucket_size == big


def test_steps_per_print_infinity_means_never_from_every_source(tmp_path: Path) -> None:
    # Accelerate / the HF Trainer put float("inf") here; json.dumps writes it as Infinity.
    for kind, source in sources(tmp_path, {**BASE, "steps_per_print": INF}).items():
        cfg = load(source)
        assert cfg.steps_per_print is None, kind  # the same as null: no progress line
        assert cfg.raw["steps_per_print"] is None, kind  # engine.config stays plain JSON
    hjson_file = tmp_path / "ds.hjson"
    hjson_file.write_text("{\n  train_micro_batch_size_per_gpu: 2\n  steps_per_print: Infinity\n}\n")
    assert load(hjson_file).steps_per_print is None
    assert load({**BASE, "steps_per_print": None}).steps_per_print is None


def test_steps_per_print_infinity_never_prints_in_training(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "ds.json"
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": INF,
    }
    path.write_text(json.dumps(config))
    for source in (config, path):
        eng, _, _, _ = engine.initialize(model=make_model(), config=source)
        try:
            for _ in range(3):
                eng.backward(eng(torch.randn(4, 16)).pow(2).mean())
                eng.step()
        finally:
            eng.destroy()
        assert eng.global_steps == 3
        assert "| loss" not in capsys.readouterr().err


def test_caller_dict_with_infinity_is_not_modified() -> None:
    config = {**BASE, "steps_per_print": INF, "optimizer": {"type": "AdamW", "params": {"lr": NAN}}}
    refused(config)
    assert config["steps_per_print"] == INF and math.isnan(config["optimizer"]["params"]["lr"])


# --- nesting ---------------------------------------------------------------------------------------


def _deep_dict(levels: int) -> dict[str, Any]:
    """A config whose deepest container is `levels` deep (the root is level 1), built without recursion."""
    inner: dict[str, Any] = {}
    for _ in range(levels - 3):
        inner = {"x": inner}
    return {**BASE, "optimizer": {"type": "AdamW", "params": inner}}


DEEP_TEXTS = [
    pytest.param('{"a": ' * 100_000 + "1" + "}" * 100_000, id="objects"),
    pytest.param('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", id="lists"),
    pytest.param("[" * 100_000 + "]" * 100_000, id="root-list"),
    pytest.param("{\n  a: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n}", id="hjson"),
]


@pytest.mark.parametrize("text", DEEP_TEXTS)
def test_deep_nesting_in_text_is_refused_with_the_limit(tmp_path: Path, text: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    for source in (path, b64(text)):
        message = refused(source)
        assert f"nests deeper than {MAX_DEPTH} levels" in message and "fix:" in message, message[:500]
        assert len(message) < 1000
    assert refused(path).startswith(f"{path}:")  # file:line:column of the container past the limit


def test_deep_nesting_in_a_braceless_hjson_file(tmp_path: Path) -> None:
    # hjson retries a braceless root that failed as a single value; the nesting message must survive that
    path = tmp_path / "ds.hjson"
    path.write_text("train_micro_batch_size_per_gpu: 2\nsparse_attention: " + "{a: " * 1000 + "1" + "}" * 1000)
    message = refused(path)
    assert message.startswith(f"{path}:2:") and f"nests deeper than {MAX_DEPTH} levels" in message, message
    path.write_text("train_micro_batch_size_per_gpu: 2\ngradient_clipping: 1e400\n")
    assert "gradient_clipping: Infinity is not a finite number" in refused(path)


def test_deep_nesting_in_a_dict_is_refused_with_the_limit() -> None:
    deep: dict[str, Any] = {}
    for _ in range(100_000):
        deep = {"a": deep}
    looped: dict[str, Any] = {**BASE}
    looped["optimizer"] = {"type": "AdamW", "params": {"self": looped}}
    for source in ({**BASE, "aio": deep}, looped):
        message = refused(source)
        assert f"nests deeper than {MAX_DEPTH} levels" in message and "fix:" in message, message[:500]
        assert len(message) < 1000


def test_nesting_limit_is_the_same_for_dict_file_and_base64(tmp_path: Path) -> None:
    for kind, source in sources(tmp_path, _deep_dict(MAX_DEPTH)).items():
        assert load(source).optimizer is not None, kind
    for kind, source in sources(tmp_path, _deep_dict(MAX_DEPTH + 1)).items():
        assert f"nests deeper than {MAX_DEPTH} levels" in refused(source), kind


def test_a_valid_config_loads_after_each_refused_one(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({**BASE, **adam()}))
    hostile = tmp_path / "bad.json"
    for text in ('{"a": ' * 100_000 + "1" + "}" * 100_000, '{"gradient_clipping": 1e400}', "[1]", "", '{"lr": NaN}'):
        hostile.write_text(text)
        refused(hostile)
        assert load(good).optimizer is not None
        assert load({**BASE, **adam()}).optimizer is not None


def _with_stack_left(frames: int, call: Callable[[], Any]) -> Any:
    """Run `call` with only about `frames` Python frames left below the recursion limit, as in a caller
    that is already deep in its own stack (a framework's hooks, a recursive launcher)."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back

    def descend(levels: int) -> Any:
        return descend(levels - 1) if levels > 0 else call()

    return descend(sys.getrecursionlimit() - depth - frames)


def test_stack_running_out_while_reading_a_config_within_the_limit_is_a_config_error(tmp_path: Path) -> None:
    # A config at the nesting limit needs ~3 frames a level in hjson and ~2 in deepcopy; with less stack
    # left than that, RecursionError used to escape with a traceback hundreds of frames long.
    for kind, source in sources(tmp_path, _deep_dict(MAX_DEPTH)).items():
        for read in (load, zero_stage):
            with pytest.raises(ConfigError) as info:
                _with_stack_left(150, lambda: read(source))  # noqa: B023 (called before the loop moves on)
            message = str(info.value)
            where = {"dict": "<dict config>", "file": str(source), "base64": "<base64 config>"}[kind]
            assert message.startswith(where), message
            assert "ran out of Python's stack" in message and "fix:" in message, message
            assert len(message) < 1000
            assert info.value.__cause__ is None and info.value.__suppress_context__
        assert load(source).optimizer is not None, kind  # the same process reads it with a normal stack


# --- other hostile files ---------------------------------------------------------------------------

HOSTILE_FILES = [
    pytest.param(b"[1, 2]", "must be a JSON object", id="list"),
    pytest.param(b'"train_batch_size"', "must be a JSON object", id="string"),
    pytest.param(b"42", "must be a JSON object", id="number"),
    pytest.param(b"", "is empty", id="empty"),
    pytest.param(b"  \n\t\n", "is empty", id="whitespace"),
    pytest.param(b"// only a comment\n/* and another */\n", "is empty", id="comments-only"),
    pytest.param(b'{"train_micro_batch_size_per_gpu": 2,\n "job": "caf\xe9"}', "not valid UTF-8", id="latin-1"),
    pytest.param(
        b'{"train_batch_size": 8,\n "train_batch_size": 16}', "duplicate key 'train_batch_size'", id="duplicate"
    ),
]


@pytest.mark.parametrize(("data", "expected"), HOSTILE_FILES)
def test_hostile_file_names_the_file_and_the_fix(tmp_path: Path, data: bytes, expected: str) -> None:
    path = tmp_path / "ds.json"
    path.write_bytes(data)
    message = refused(path)
    assert message.startswith(str(path)) and expected in message, message
    assert "fix:" in message or "remove one of them" in message, message


def test_non_utf8_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"train_micro_batch_size_per_gpu": 2,\n "job": "caf\xe9"}')
    message = refused(path)
    assert message.startswith(f"{path}:2:") and "0xe9" in message and "save the file as UTF-8" in message


def test_base64_of_a_non_object_says_so() -> None:
    for text in ("[1, 2]", "[" * 100_000):
        message = refused(b64(text))
        assert message.startswith("<base64 config>"), message[:300]


def test_file_with_utf8_bom_loads(tmp_path: Path) -> None:
    text = "\ufeff" + json.dumps({**BASE, **adam(lr=0.5)})
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    cfg = load(path)
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == 0.5
    assert load(b64(text)).train_micro_batch_size_per_gpu == 2


def test_directory_is_refused_for_str_and_pathlike(tmp_path: Path) -> None:
    for source in (str(tmp_path), tmp_path):
        message = refused(source)
        assert str(tmp_path) in message and "is a directory" in message and "pass the JSON file" in message


def test_zero_stage_read_before_initialize_names_a_bad_stage(tmp_path: Path) -> None:
    # engine.zero.Init reads the stage before load_config runs; int(NaN) used to escape from there
    for stage in (NAN, INF):
        for source in sources(tmp_path, {**BASE, "zero_optimization": {"stage": stage}}).values():
            with pytest.raises(ConfigError, match=r"zero_optimization\.stage: .* is not one of 0, 1, 2, 3"):
                zero_stage(source)
    assert zero_stage(sources(tmp_path, {**BASE, "zero_optimization": {"stage": 3}})["file"]) == 3
