"""The support table: refused keys, warned-once keys, and the frozen config surface (every config key
mapped to one typed field or to a row of the table)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections import Counter
from typing import Any

import pytest

from engine.config import ConfigError, ConfigWarning, EngineConfig, load_config, support
from engine.config.aliases import TOP_LEVEL_ALIASES
from engine.config.build import FIELD_OF_KEY
from engine.config.support import TABLE, Status
from engine.config.validate import schema, top_level_keys
from engine.config.warn import reset_warned

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}


def load(extra: dict[str, Any]) -> EngineConfig:
    return load_config({**BASE, **extra}, world_size=1, world_size_source="test")


def refusal(extra: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra)
    (message,) = info.value.problems
    return message


@pytest.mark.parametrize(
    "extra, key",
    [
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}},
            "zero_optimization.offload_optimizer.super_offload",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            "zero_optimization.offload_optimizer.ratio",
        ),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        (
            {"zero_optimization": {"zero_quantized_gradients": True}},
            "zero_optimization.zero_quantized_gradients",
        ),
        ({"zero_optimization": {"mics_shard_size": 4}}, "zero_optimization.mics_shard_size"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"quantize_training": {"enabled": True}}, "quantize_training.enabled"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled"),
        ({"optimizer": {"type": "onebitlamb"}}, "optimizer.type"),
        ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype"),
        ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type"),
        ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
        ({"elasticity": {"enabled": True}}, "elasticity.enabled"),
        ({"compression_training": {"weight_quantization": {}}}, "compression_training"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning.enabled"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled"),
        ({"progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop.enabled"),
        ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled"),
        ({"tensor_parallel": {"tp": {"tp_size": 2}}}, "tensor_parallel"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ],
)
def test_refused_keys_name_key_and_fix(extra: dict[str, Any], key: str) -> None:
    message = refusal(extra)
    assert message.startswith(f"{key}: ") and " is not supported: " in message and "; fix: " in message


def test_offload_refusal_says_what_to_do() -> None:
    assert refusal({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}).endswith(
        "fix: remove ratio (or set it to 1)"
    )
    assert (
        load(
            {"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
        ).zero.offload_optimizer.device
        == "cpu"
    )


@pytest.mark.parametrize(
    "extra",
    [
        {
            "zero_optimization": {
                "stage": 0,
                "reduce_bucket_size": 1e7,
                "contiguous_gradients": False,
                "overlap_comm": True,
                "allgather_bucket_size": 2e8,
                "round_robin_gradients": True,
                "stage3_max_live_parameters": 1e9,
                "offload_optimizer": {"device": "none"},
            }
        },
        {"fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 12}},
        {"bf16": {"enabled": False}},
        {"amp": {"enabled": False}},
        {"communication_data_type": "fp32"},
        {"data_types": {"grad_accum_dtype": "fp32"}},
        {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "loss_scale": 0, "auto_cast": False}},
        {
            "zero_optimization": {"stage": 2, "overlap_comm": True},
            "bf16": {"enabled": True},
            "communication_data_type": "fp16",
            "data_types": {"grad_accum_dtype": "bf16"},
            "comms_logger": {"enabled": True},
        },
        {"elasticity": {"enabled": False, "max_train_batch_size": 100}},
        {"tensor_parallel": {"autotp_size": 1}},
        # Sections that only restate DeepSpeed's defaults are not worth a warning.
        {"activation_checkpointing": {"partition_activations": False, "number_checkpoints": None}},
        {"checkpoint": {"tag_validation": "WARN", "parallel_write": {"pipeline_stage": False}}},
        {"timers": {"throughput": {"enabled": True, "synchronized": True}}},
        {"tensorboard": {"enabled": False, "output_path": "tb"}, "wandb": {"enabled": False}},
        {
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "dataloader_drop_last": True,
        },
    ],
)
def test_disabled_or_implemented_features_load_silently(extra: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load(extra)


def test_implemented_values_reach_engine_config() -> None:
    cfg = load(
        {
            "gradient_clipping": 0.5,
            "prescale_gradients": True,
            "gradient_predivide_factor": 2,
            "steps_per_print": 5,
            "wall_clock_breakdown": True,
            "dataloader_drop_last": True,
            "csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "j"},
            "zero_optimization": {"reduce_bucket_size": 2e6, "contiguous_gradients": False},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        }
    )
    assert (cfg.gradient_clipping, cfg.prescale_gradients, cfg.gradient_predivide_factor) == (0.5, True, 2.0)
    assert cfg.steps_per_print == 5 and cfg.wall_clock_breakdown and cfg.dataloader_drop_last
    assert cfg.csv_monitor.enabled and cfg.csv_monitor.output_path == "runs" and cfg.csv_monitor.job_name == "j"
    assert cfg.zero.reduce_bucket_size == 2_000_000  # contiguous_gradients: accepted, nothing reads it
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_num_steps"] == 10


def test_stages_precision_and_dtypes_reach_engine_config() -> None:
    cfg = load({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 12}})
    assert cfg.zero.stage == 2 and cfg.fp16.enabled and cfg.fp16.initial_scale_power == 12
    assert not cfg.bf16.enabled and cfg.grad_accum_dtype is None and cfg.comms_logger is False
    cfg = load({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}})
    assert cfg.zero.stage == 1 and cfg.bf16.enabled and not cfg.fp16.enabled


@pytest.mark.parametrize(
    "section, size",
    [
        (None, 1),
        ({"autotp_size": 0}, 1),
        ({"autotp_size": 1}, 1),
        ({"autotp_size": 2}, 2),
        ({"autotp_size": 2, "tp": {"tp_size": 2}}, 2),
        ({"autotp_size": 2, "tp": {"tp_size": 1}}, 2),
    ],
)
def test_autotp_size_reaches_engine_config(section: dict[str, Any] | None, size: int) -> None:
    extra = {} if section is None else {"tensor_parallel": section}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        cfg = load_config({**BASE, **extra}, world_size=2, world_size_source="test")
    assert cfg.autotp_size == size


def test_tp_size_other_than_autotp_size_is_refused() -> None:
    for section in (
        {"tp": {"tp_size": 2}},
        {"autotp_size": 0, "tp": {"tp_size": 2}},
        {"autotp_size": 2, "tp": {"tp_size": 4}},
    ):
        with pytest.raises(ConfigError) as info:
            load_config({**BASE, "tensor_parallel": section}, world_size=4, world_size_source="test")
        (message,) = info.value.problems
        assert message.startswith(
            f"tensor_parallel: {json.dumps(section)} is not supported: "
            "tensor_parallel.tp.tp_size (the size DeepSpeed's inference engine reads) must "
            "equal tensor_parallel.autotp_size when above 1"
        ), message
        assert message.endswith("fix: set tensor_parallel.tp.tp_size to the autotp_size value, or remove it")


def test_comms_logger_is_implemented_not_warned() -> None:
    reset_warned()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load({"comms_logger": {"enabled": True, "verbose": False}}).comms_logger is True
        assert load({"comms_logger": {"enabled": False}}).comms_logger is False


@pytest.mark.parametrize(
    "written, name",
    [
        ("fp32", "fp32"),
        ("float", "fp32"),
        ("torch.float32", "fp32"),
        ("float16", "fp16"),
        ("half", "fp16"),
        ("torch.float16", "fp16"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("torch.bfloat16", "bf16"),
    ],
)
def test_grad_accum_dtype_spellings_load_as_short_names(written: str, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load({"data_types": {"grad_accum_dtype": written}}).grad_accum_dtype == name


@pytest.mark.parametrize("written, name", [("fp32", "fp32"), ("FP16", "fp16"), ("fp16", "fp16"), ("Bf16", "bf16")])
def test_communication_data_type_loads_as_short_name(written: str, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load({"communication_data_type": written}).communication_data_type == name


def test_int8_dtypes_are_refused_by_key() -> None:
    message = refusal({"data_types": {"grad_accum_dtype": "int8"}})
    assert message.startswith('data_types.grad_accum_dtype: "int8" is not supported: ')
    message = refusal({"data_types": {"grad_accum_dtype": "torch.int8"}})
    assert message.startswith('data_types.grad_accum_dtype: "torch.int8" is not supported: ')
    # DeepSpeed's get_communication_data_type accepts only fp32/fp16/bf16 (any case); the schema says so.
    for written in ("int8", "torch.float16"):
        message = refusal({"communication_data_type": written})
        assert message.startswith(f"communication_data_type: '{written}' does not match"), message


def test_warned_key_is_warned_once_per_process() -> None:
    reset_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load({"trackio": {"enabled": True, "project": "p"}})
        load({"trackio": {"enabled": True, "project": "p"}})
    mine = [w for w in caught if issubclass(w.category, ConfigWarning) and "trackio.enabled" in str(w.message)]
    assert len(mine) == 1
    assert "no writer for it in this engine yet" in str(mine[0].message)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"trackio": {"enabled": True}}, "trackio.enabled"),
        ({"checkpoint": {"tag_validation": "Fail"}}, "checkpoint"),
        ({"dump_state": True}, "dump_state"),
        ({"sparse_gradients": True}, "sparse_gradients"),
        ({"timers": {"throughput": {"enabled": False}}}, "timers"),
    ],
)
def test_warned_keys(extra: dict[str, Any], key: str) -> None:
    reset_warned()
    with pytest.warns(ConfigWarning, match=f"^{key}: .* is accepted but has no effect here"):
        load(extra)


def test_warnings_not_spent_on_a_failed_load() -> None:
    reset_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError):
            load(
                {
                    "trackio": {"enabled": True},
                    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
                }
            )
        load({"trackio": {"enabled": True}})
    assert sum("trackio.enabled" in str(w.message) for w in caught) == 1


# --- surface freeze: keys, schema, table and dataclass fields stay in step -------------------------------


def test_every_top_level_schema_key_is_mapped_or_in_the_table() -> None:
    table_tops = {entry.path.split(".")[0] for entry in TABLE}
    missing = [k for k in top_level_keys() if k not in FIELD_OF_KEY and k not in table_tops]
    assert not missing, f"top-level keys neither mapped into EngineConfig nor in the support table: {missing}"
    assert set(top_level_keys()) <= table_tops, "every top-level key should have a row in docs/config-keys.md"


def test_field_mapping_matches_schema_and_dataclass() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(FIELD_OF_KEY) <= set(top_level_keys())
    assert set(FIELD_OF_KEY.values()) <= fields
    unmapped = fields - set(FIELD_OF_KEY.values()) - {"world_size", "raw"}
    assert not unmapped, f"EngineConfig fields no config key fills: {unmapped}"


def test_key_table_reaches_every_field_from_one_canonical_key() -> None:
    """FIELD_OF_KEY is the one key -> field mapping: each EngineConfig field a config key fills is the
    target of exactly one key, every key names a field, and no key is an alias (aliases.py renames those
    before the build, so a table row for one would be a second, dead spelling)."""
    not_from_keys = {"world_size", "raw"}  # the resolved world size and the user's JSON, not config keys
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - not_from_keys
    keys_per_field = Counter(FIELD_OF_KEY.values())
    assert set(keys_per_field) == fields, (
        f"fields no key fills: {fields - set(keys_per_field)}; keys naming no field: "
        f"{sorted(k for k, f in FIELD_OF_KEY.items() if f not in fields)}"
    )
    assert {f: n for f, n in keys_per_field.items() if n > 1} == {}
    assert set(FIELD_OF_KEY).isdisjoint(TOP_LEVEL_ALIASES)


def test_engine_config_is_built_from_the_key_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build reads FIELD_OF_KEY, not a list of its own: a key dropped from the table no longer
    arrives, and a key pointed at another field fills that field."""
    extra = {"seed": 7, "steps_per_print": 3}
    cfg = load(extra)
    assert (cfg.seed, cfg.steps_per_print) == (7, 3)
    monkeypatch.delitem(FIELD_OF_KEY, "seed")
    assert load(extra).seed is None
    monkeypatch.setitem(FIELD_OF_KEY, "steps_per_print", "seed")
    cfg = load(extra)
    assert (cfg.seed, cfg.steps_per_print) == (3, None)


def test_table_paths_exist_in_the_schema() -> None:
    for entry in TABLE:
        node: Any = schema()
        for part in entry.path.split("."):
            props = _properties(node)
            if props is None:  # an open section: deeper keys are not described
                break
            assert part in props, f"support table path {entry.path!r} is not in schema.json"
            node = props[part]


def _properties(node: dict[str, Any]) -> dict[str, Any] | None:
    root = schema()
    while "$ref" in node:
        target: Any = root
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    for branch in node.get("anyOf", []):
        found = _properties(branch)
        if found:
            return found
    return node.get("properties")


def test_implemented_top_level_keys_are_mapped() -> None:
    for entry in TABLE:
        if entry.status is Status.IMPLEMENTED and "." not in entry.path:
            assert entry.path in FIELD_OF_KEY, entry.path


def test_every_refusal_and_warning_has_reason_and_fix() -> None:
    for entry in TABLE:
        if entry.status in (Status.REFUSED, Status.WARNED):
            assert entry.reason and entry.fix, entry.path


# The table's one copy; tests/test_docs.py checks the README holds none.
@pytest.mark.parametrize("doc", [support.DOC_FILE])
def test_docs_table_matches_the_generated_table(doc) -> None:
    text = doc.read_text(encoding="utf-8")
    assert support.render_doc(text) == text, (
        f'{doc.name} is out of date; run: python -c "from pathlib import Path; from engine.config.support '
        f"import write_docs; write_docs(Path('{doc.relative_to(support.DOC_FILE.parents[1])}'))\""
    )
    assert support.support_table_markdown() in text
