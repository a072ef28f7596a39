"""DeepSpeed's configurable AutoTP (tensor_parallel.partition_config, preset_model) read into the
engine's AutoTP plan (engine/config/autotp_specs.py): the plans it makes, and every refusal by key
path at config load. That a plan with fused parts trains to DeepSpeed's own numbers is checked by
tests/test_deepspeed_tp_checkpoint.py (the fused fixture resumed at TP 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import engine.parallel as mpu
from engine.config import load_config
from engine.config.autotp_specs import read_specs
from engine.config.errors import ConfigError
from engine.parallel import autotp
from tests.test_autotp import tiny_llama
from tests.test_deepspeed_checkpoints import load_script

FIXTURE = Path(__file__).parent / "data" / "deepspeed_tp_checkpoint" / "make_fixture.py"


def _fused() -> tuple[torch.nn.Module, dict[str, Any]]:
    """The fused fixture's model and its DeepSpeed tensor_parallel section (real DeepSpeed trained it)."""
    fixture = load_script(FIXTURE)
    return fixture.make_model(seed=0, case=fixture.FUSED_CASE), fixture.ds_config(fixture.FUSED_CASE)["tensor_parallel"]


def test_a_partition_config_with_fused_parts_plans_each_part_split() -> None:
    model, section = _fused()
    plan, parts = autotp._plan(model, 2, None, read_specs(section))
    block = {
        "input_norm": "replicate",
        "qkv_proj": "column",
        "o_proj": "row",
        "post_norm": "replicate",
        "gate_up_proj": "column",
        "down_proj": "row",
    }
    expected = [
        ("embed_tokens", "replicate"),
        *[(f"layers.{i}.{name}", kind) for i in range(2) for name, kind in block.items()],
        ("norm", "replicate"),
        ("lm_head", "replicate"),  # no spec matches it: DeepSpeed leaves it whole too
    ]
    assert plan == expected
    assert parts == {f"layers.{i}.{n}": k for i in range(2) for n, k in (("qkv_proj", 3), ("gate_up_proj", 2))}
    # Without the specs the engine's own rules leave gate_up_proj whole, which the row layer after it
    # could not take: the config's specs are what make this model shardable.
    assert dict(mpu.plan_autotp(model, 2))["layers.0.gate_up_proj"] == "replicate"


def test_the_llama_preset_plans_what_the_engine_rules_plan() -> None:
    model = tiny_llama()
    assert mpu.plan_autotp(model, 2, specs=read_specs({"preset_model": "llama"})) == mpu.plan_autotp(model, 2)


def test_specs_are_tried_before_the_preset_unless_use_default_specs_is_false() -> None:
    model = tiny_llama()
    skip_first_mlp = {"patterns": [r".*layers\.0\.mlp\.(gate|up|down)_proj\.weight$"], "partition_type": "skip"}
    merged = {"preset_model": "llama", "partition_config": {"layer_specs": [skip_first_mlp]}}
    plan = dict(mpu.plan_autotp(model, 2, specs=read_specs(merged)))
    assert [plan[f"model.layers.0.mlp.{n}"] for n in ("gate_proj", "up_proj", "down_proj")] == ["replicate"] * 3
    assert [plan[f"model.layers.1.mlp.{n}"] for n in ("gate_proj", "up_proj", "down_proj")] == ["column"] * 2 + ["row"]
    alone = {**merged, "partition_config": {"use_default_specs": False, "layer_specs": [skip_first_mlp]}}
    with pytest.raises(ConfigError, match="no module matches a sharding rule"):
        mpu.plan_autotp(model, 2, specs=read_specs(alone))


def test_model_types_limit_a_spec_to_those_models() -> None:
    only_gpt2 = {
        "partition_config": {
            "layer_specs": [{"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row", "model_types": ["GPT2"]}]
        },
        "preset_model": "llama",
    }
    plan = dict(mpu.plan_autotp(tiny_llama(), 2, specs=read_specs(only_gpt2)))
    assert plan["model.layers.0.self_attn.o_proj"] == "row"  # from the preset: the gpt2 spec does not apply


def test_strict_mode_names_every_linear_no_spec_matches() -> None:
    model, section = _fused()
    strict = {
        "partition_config": {**section["partition_config"], "strict_mode": True},
    }
    with pytest.raises(ConfigError) as info:
        mpu.plan_autotp(model, 2, specs=read_specs(strict))
    assert info.value.problems == [
        (
            "lm_head: no layer spec matches lm_head.weight and tensor_parallel.partition_config.strict_mode is "
            "true; add a layer spec for it (partition_type skip keeps it whole)"
        )
    ]


def test_parts_that_do_not_divide_are_refused_with_the_numbers() -> None:
    model, _ = _fused()
    specs = read_specs(
        {
            "partition_config": {
                "layer_specs": [
                    {"patterns": [r".*\.qkv_proj\.weight$"], "partition_type": "column", "shape": [5, -1]},
                    {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                ]
            }
        }
    )
    with pytest.raises(ConfigError) as info:
        mpu.plan_autotp(model, 2, specs=specs)
    assert info.value.problems[0].startswith(
        "layers.0.qkv_proj: out_features 48 is not 5 equal parts each divisible by tp_size 2 (its layer spec's "
        "shape [5, -1])"
    )


REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {"partition_config": {"layer_specs": [{"patterns": ["qkv"], "shape": [[32, 8, 8], -1]}]}},
        r"tensor_parallel\.partition_config\.layer_specs\[0\]\.shape: \[\[32, 8, 8\], -1\] declares parts of unequal",
    ),
    (
        {"partition_config": {"layer_specs": [{"patterns": ["head"], "gather_output": True}]}},
        r"layer_specs\[0\]\.gather_output: a column layer whose output is gathered",
    ),
    (
        {
            "partition_config": {
                "layer_specs": [{"patterns": ["norm"], "partition_type": "skip", "grad_allreduce": True}]
            }
        },
        r"layer_specs\[0\]\.grad_allreduce: summing a replicated layer's gradients",
    ),
    (
        {
            "partition_config": {
                "layer_specs": [{"patterns": ["o_proj"], "partition_type": "column", "partition_dim": 1}]
            }
        },
        r"layer_specs\[0\]\.partition_dim: 1 on a column layer",
    ),
    (
        {"partition_config": {"layer_specs": [{"patterns": ["o_proj"], "partition_type": "row", "shape": [2, -1]}]}},
        r"layer_specs\[0\]\.shape: \[2, -1\] on a row layer",
    ),
    (
        {"partition_config": {"layer_specs": [{"patterns": ["(o_proj"], "partition_type": "row"}]}},
        r"layer_specs\[0\]\.patterns\[0\]: '\(o_proj' is not a valid regular expression",
    ),
    (
        {"partition_config": {"layer_specs": [{"patterns": ["o_proj"], "partition_type": "diagonal"}]}},
        r"layer_specs\[0\]\.partition_type: 'diagonal' is not column, row or skip",
    ),
    (
        {"partition_config": {"embedding_partition_dim": 0}},
        r"tensor_parallel\.partition_config\.embedding_partition_dim: 0 steers DeepSpeed's vocabulary-parallel",
    ),
    ({"preset_model": "gpt5"}, r"tensor_parallel\.preset_model: 'gpt5' is not a DeepSpeed preset; the presets: llama"),
    ({"vocab_parallel_lm_head": True}, r"tensor_parallel\.vocab_parallel_lm_head: true .*not supported"),
    ({"kernel_inject": True}, r"tensor_parallel\.kernel_inject: true .*inference kernels"),
    ({"partiton_config": {}}, r"tensor_parallel\.partiton_config: unknown key; did you mean partition_config\?"),
]


@pytest.mark.parametrize(("section", "message"), REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_the_engine_cannot_do_is_refused_at_load_by_key_path(section: dict[str, Any], message: str) -> None:
    config = {"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2, **section}}
    with pytest.raises(ConfigError, match=message):
        load_config(config, world_size=2, world_size_source="test")


def test_a_shipped_style_partition_config_loads() -> None:
    _, section = _fused()
    config = load_config({"train_batch_size": 4, "tensor_parallel": section}, world_size=2, world_size_source="test")
    assert config.autotp_size == 2
    specs = read_specs(config.raw["tensor_parallel"])  # what AutoTP reads at initialize: the frozen raw config
    assert specs is not None and [s.parts for s in specs.specs] == [1, 3, 2]


def _shard_then_initialize(with_config: bool) -> str:
    import engine

    model, section = _fused()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "tensor_parallel": section}
    engine.tp_model_init(model, 2, config=config if with_config else None)
    try:
        eng, *_ = engine.initialize(model=model, config=config)
    except ConfigError as e:
        return str(e)
    eng.destroy()
    return "initialized"


@pytest.mark.parametrize("with_config", [True, False])
def test_a_model_sharded_before_initialize_must_match_the_configs_specs(with_config: bool) -> None:
    """engine.tp_model_init(model, 2) without the config plans by the engine's name rules; an
    initialize whose config has a partition_config must not train that split as if it were the one
    asked for."""
    from tests.distributed import run_distributed

    got = run_distributed(_shard_then_initialize, world_size=2, args=(with_config,), timeout=120)[0]
    if with_config:
        assert got == "initialized"
    else:
        assert got.startswith(
            "the model was already sharded by engine.tp_model_init with the engine's name rules, but the config "
            "asks for its tensor_parallel.partition_config / preset_model layer specs"
        ), got
