"""load_config: sources, syntax, schema, unknown keys, aliases, "auto", problems reported together."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, ConfigWarning, EngineConfig, load_config
from engine.config.warn import reset_warned

WS_SOURCE = "WORLD_SIZE env (torchrun)"
BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    reset_warned()  # deprecation warnings are once per process; each test here checks its own


def load(cfg: Any, world_size: int = 1) -> EngineConfig:
    return load_config(cfg, world_size=world_size, world_size_source=WS_SOURCE)


def problems_of(cfg: Any, world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(cfg, world_size)
    return info.value.problems


def write(tmp_path: Path, text: str, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- sources --------------------------------------------------------------------------------------


def test_hjson_comments_and_trailing_commas_load(tmp_path: Path) -> None:
    text = """{
      // line comment
      "train_micro_batch_size_per_gpu": 4, # hash comment
      /* block
         comment */
      "gradient_accumulation_steps": 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],},},
    }"""
    cfg = load(write(tmp_path, text), world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (16, 2)
    assert cfg.optimizer is not None and cfg.optimizer.params["betas"] == (0.9, 0.95)


def test_path_as_str_and_pathlike(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(BASE))
    assert load(str(path)).train_batch_size == 2
    assert load(path).train_batch_size == 2


def test_syntax_error_has_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "train_batch_size": 8,\n  "optimizer": {"type" "Adam"}\n}')
    (message,) = problems_of(path)
    assert message.startswith(f"{path}:3:")
    assert "Expecting ':'" in message


def test_duplicate_key_names_key_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n "train_batch_size": 8,\n "train_batch_size": 16\n}')
    (message,) = problems_of(path)
    assert message.startswith(f"{path}:3:")
    assert "duplicate key 'train_batch_size'" in message


def test_nested_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path, '{"train_batch_size": 8, "zero_optimization": {"stage": 0, "stage": 0}}')
    assert "duplicate key 'stage'" in problems_of(path)[0]


def test_missing_file_names_path_and_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (message,) = problems_of("no_such_dir/ds_config.json")
    assert "no_such_dir/ds_config.json" in message and str(tmp_path) in message
    (message,) = problems_of(tmp_path / "gone.json")
    assert "gone.json" in message and "current directory" in message


def test_base64_config_standard_and_urlsafe() -> None:
    text = json.dumps({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}).encode()
    for encoded in (base64.b64encode(text).decode(), base64.urlsafe_b64encode(text).decode()):
        cfg = load(encoded, world_size=2)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 4)


def test_base64_syntax_error_is_located() -> None:
    encoded = base64.b64encode(b'{"train_batch_size": 8,, }').decode()
    assert problems_of(encoded)[0].startswith("<base64 config>:1:")


def test_dict_source_is_not_modified() -> None:
    # "auto" and the legacy zero_optimization: true (= stage 1) are both rewritten during loading.
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "zero_optimization": True}
    snapshot = json.loads(json.dumps(cfg))
    with pytest.warns(ConfigWarning, match='boolean form of "zero_optimization" is deprecated'):
        assert load(cfg).zero.stage == 1
    assert cfg == snapshot
    failing = {**cfg, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}  # refused
    snapshot = json.loads(json.dumps(failing))
    with pytest.raises(ConfigError):
        load(failing)
    assert failing == snapshot


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert "is a directory" in problems_of(str(tmp_path))[0]


def test_root_must_be_an_object(tmp_path: Path) -> None:
    assert "must be a JSON object" in problems_of(write(tmp_path, "[1, 2]"))[0]


# --- schema ----------------------------------------------------------------------------------------


def test_schema_violation_names_key_path() -> None:
    assert problems_of({**BASE, "zero_optimization": {"stage": 5}}) == [
        "zero_optimization.stage: 5 is not one of [0, 1, 2, 3]"
    ]


@pytest.mark.parametrize(
    "cfg, expected",
    [
        ({"train_batch_size": 0}, "train_batch_size: 0 is less than the minimum of 1"),
        ({**BASE, "gradient_clipping": -1}, "gradient_clipping: -1 is less than the minimum of 0"),
        (
            {**BASE, "gradient_clipping": "big"},
            'gradient_clipping: "big" is not valid; expected number or "auto"',
        ),
        (
            {**BASE, "fp16": {"enabled": "yes"}},
            'fp16.enabled: "yes" is not valid; expected boolean or "auto"',
        ),
        ({**BASE, "communication_data_type": "int8"}, "communication_data_type: 'int8' does not match"),
        (
            {**BASE, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device: 'gpu' is not one of ['none', 'cpu', 'nvme']",
        ),
        ({**BASE, "checkpoint": {"tag_validation": "Sometimes"}}, "checkpoint.tag_validation: 'Sometimes'"),
        (
            {**BASE, "optimizer": {"params": {"lr": 1}}},
            "optimizer: missing required key; 'type' is a required",
        ),
        (
            {**BASE, "zero_optimization": {"reduce_bucket_size": 1.5}},
            "zero_optimization.reduce_bucket_size: 1.5",
        ),
    ],
)
def test_schema_violations(cfg: dict[str, Any], expected: str) -> None:
    found = problems_of(cfg)
    assert any(p.startswith(expected) for p in found), found


def test_communication_dtype_case_insensitive_fp32_accepted() -> None:
    assert load({**BASE, "communication_data_type": "FP32"}).communication_data_type == "fp32"


def test_unknown_top_level_key_suggests_closest() -> None:
    assert problems_of({**BASE, "zero_optimisation": {"stage": 0}}) == [
        "zero_optimisation: unknown key; did you mean zero_optimization?"
    ]


def test_unknown_nested_keys_suggest_closest() -> None:
    found = problems_of(
        {
            **BASE,
            "zero_optimization": {"overlap_com": True, "offload_param": {"devcie": "none"}},
            "fp16": {"enable": False},
        }
    )
    assert "zero_optimization.overlap_com: unknown key; did you mean overlap_comm?" in found
    assert "zero_optimization.offload_param.devcie: unknown key; did you mean device?" in found
    assert "fp16.enable: unknown key; did you mean enabled?" in found


def test_unknown_top_level_key_without_close_match_is_ignored_by_name() -> None:
    # Issue 30: DeepSpeed ignores unknown top-level keys; refused before, now warned (the rest of the policy,
    # typos, comments and dotted keys: tests/test_config_real_configs.py).
    with pytest.warns(ConfigWarning, match=r"^qqqqqq: unknown top-level key, ignored .* see docs/config-keys.md"):
        assert load({**BASE, "qqqqqq": 1}).train_micro_batch_size_per_gpu == 2


def test_file_problems_are_prefixed_with_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({**BASE, "zero_optimisation": {}}))
    assert problems_of(path) == [f"{path}: zero_optimisation: unknown key; did you mean zero_optimization?"]


def test_several_problems_reported_together() -> None:
    cfg = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimisation": {},
        "zero_optimization": {"stage": 3, "overlap_com": True, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
    }
    with pytest.raises(ConfigError) as info:
        load(cfg, world_size=2)
    found = info.value.problems
    assert len(found) == 6, found
    text = str(info.value)
    assert text.startswith("6 problems in the config:")
    for fragment in (
        "zero_optimisation: unknown key",
        "zero_optimization.overlap_com: unknown key",
        "zero_optimization.offload_optimizer.ratio: 0.5 is not supported",
        "fp16.fp16_master_weights_and_grads: true is not supported",
        'optimizer.params.lr: "auto"',
        "train_batch_size (32) != ",
    ):
        assert fragment in text


# --- aliases -----------------------------------------------------------------------------------------


def test_bfloat16_alias_maps_to_bf16() -> None:
    with pytest.warns(ConfigWarning, match="bfloat16 is read as bf16"):
        assert load({**BASE, "bfloat16": {"enabled": False}}).bf16.enabled is False
    reset_warned()
    with pytest.warns(ConfigWarning, match="bfloat16 is read as bf16"):
        cfg = load({**BASE, "bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True and cfg.fp16.enabled is False
    found = problems_of({**BASE, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert any(p.startswith("fp16.enabled and bf16.enabled are both true") for p in found), found


def test_alias_and_canonical_together_is_an_error() -> None:
    found = problems_of({**BASE, "bf16": {"enabled": False}, "bfloat16": {"enabled": False}})
    assert found == ["bfloat16: given together with bf16, which it is another name for; keep only bf16"]


def test_zero_optimization_true_is_stage_1() -> None:
    with pytest.warns(ConfigWarning, match='boolean form of "zero_optimization" is deprecated'):
        cfg = load({**BASE, "zero_optimization": True})
    assert cfg.zero.stage == 1
    assert cfg.zero == load({**BASE, "zero_optimization": {"stage": 1}}).zero
    reset_warned()
    with pytest.warns(ConfigWarning, match='boolean form of "zero_optimization" is deprecated'):
        assert load({**BASE, "zero_optimization": False}).zero.stage == 0


def test_cpu_offload_maps_to_offload_optimizer_cpu() -> None:
    reset_warned()
    with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload is deprecated"):
        assert (
            load({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}}).zero.offload_optimizer.device
            == "cpu"
        )
    reset_warned()
    with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload is deprecated"):
        assert load({**BASE, "zero_optimization": {"cpu_offload": False}}).zero.offload_optimizer.device == "none"


def test_stage3_names_without_prefix_and_old_gather_name() -> None:
    with pytest.warns(ConfigWarning) as caught:
        cfg = load(
            {
                **BASE,
                "zero_optimization": {
                    "prefetch_bucket_size": 1e6,
                    "max_live_parameters": 7,
                    "stage3_gather_fp16_weights_on_model_save": True,
                },
            }
        )
    # Only the old fp16 name is deprecated; the prefix-less stage3 names are a documented spelling.
    assert [str(w.message).split()[0] for w in caught] == ["zero_optimization.stage3_gather_fp16_weights_on_model_save"]
    assert cfg.zero.stage3_prefetch_bucket_size == 1_000_000
    assert isinstance(cfg.zero.stage3_prefetch_bucket_size, int)
    assert cfg.zero.stage3_max_live_parameters == 7
    assert cfg.zero.stage3_gather_16bit_weights_on_model_save is True


def test_overlap_comm_null_resolves_by_stage() -> None:
    assert load({**BASE, "zero_optimization": {"overlap_comm": None}}).zero.overlap_comm is False
    assert load({**BASE, "zero_optimization": {"overlap_comm": True}}).zero.overlap_comm is True


def test_fp16_and_bf16_both_enabled_is_an_error() -> None:
    found = problems_of({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert any(p.startswith("fp16.enabled and bf16.enabled are both true") for p in found)


# --- "auto" --------------------------------------------------------------------------------------


def test_batch_auto_resolved_from_the_other_two(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.config"):
        cfg = load(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            world_size=2,
        )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        16,
        4,
        2,
    )
    assert 'train_batch_size: "auto" resolved to 16' in caplog.text
    cfg = load(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
        world_size=2,
    )
    assert cfg.gradient_accumulation_steps == 2


def test_batch_auto_with_nothing_to_infer_from_is_refused_by_name() -> None:
    found = problems_of({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert found == [
        f'{k}: "auto" can only be filled in by the Hugging Face Trainer and cannot be inferred '
        "from the other batch keys here; write a number"
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu")
    ]


def test_zero_sizes_auto_take_deepspeed_defaults(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.config"):
        cfg = load(
            {
                **BASE,
                "zero_optimization": {
                    "reduce_bucket_size": "auto",
                    "stage3_prefetch_bucket_size": "auto",
                    "stage3_param_persistence_threshold": "auto",
                    "stage3_max_live_parameters": "auto",
                },
            }
        )
    assert cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.zero.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.zero.stage3_param_persistence_threshold == 100_000
    assert 'zero_optimization.reduce_bucket_size: "auto" -> DeepSpeed default 500000000' in caplog.text


def test_auto_refused_by_name_where_only_hf_can_fill_it() -> None:
    cfg = {
        **BASE,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
    }
    found = problems_of(cfg)
    assert 'optimizer.params.lr: "auto" can only be filled in by the Hugging Face Trainer; write a number' in found
    assert any(p.startswith('optimizer.params.betas: "auto"') for p in found)
    assert any(p.startswith('scheduler.params.warmup_num_steps: "auto"') for p in found)
    assert any(p.startswith('gradient_clipping: "auto"') for p in found)
    assert 'fp16.enabled: "auto" can only be filled in by the Hugging Face Trainer; write true or false' in found
    assert len(found) == 5


# --- result ----------------------------------------------------------------------------------------


def test_result_is_frozen_with_read_only_raw() -> None:
    src = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "seed": 7}
    cfg = load(src)
    with pytest.raises(AttributeError):
        cfg.train_batch_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.raw["seed"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        cfg.optimizer.params["lr"] = 3  # type: ignore[index, union-attr]
    assert cfg.raw["optimizer"]["params"]["lr"] == 0.01 and cfg.seed == 7


def test_defaults_match_deepspeed() -> None:
    cfg = load(BASE)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None
    assert cfg.zero.stage == 0 and cfg.zero.reduce_bucket_size is None and cfg.zero.overlap_comm is False
    assert cfg.zero.offload_optimizer.device == "none" and cfg.zero.offload_param.device == "none"
    assert cfg.communication_data_type is None and cfg.zero.stage3_prefetch_bucket_size == 50_000_000


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="world_size must be a positive int"):
        load_config(BASE, world_size=0, world_size_source="test")


def test_cwd_independent_schema_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert os.getcwd() == str(tmp_path)
    assert load(BASE).train_batch_size == 2
