"""AutoTP (engine/parallel/autotp.py): the plan it makes for real models, every refusal, and a sharded
GPT against the dense one on two real processes.

Tolerance, fp32: the sharded model does the dense model's products, but a row-parallel layer sums its
dot products as two half-sums plus an all-reduce, and that rounding passes through layer norms and
softmax over two blocks (measured max 3e-8 on the logits, 1.2e-7 on the gradients); 1e-5 allows it and
catches any real error (qkv split as one block instead of three parts is off by 7e-2 on logits of 0.26).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import engine
import engine.parallel as mpu
from engine.config.errors import ConfigError
from tests.distributed import run_distributed

TOL = 1e-5
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig


def _gpt(n_heads: int = 2, d_model: int = 16) -> GPT:
    torch.manual_seed(3)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=d_model, n_layers=2, n_heads=n_heads))


def _refusal(model: nn.Module, tp_size: int, rules: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        mpu.plan_autotp(model, tp_size, rules)
    return info.value.problems


# ------------------------------------------------------------------ plans of real models
def test_plan_of_the_main_jobs_gpt() -> None:
    block = [
        ("ln1", "replicate"),
        ("qkv", "column_fused_qkv"),
        ("proj", "row"),
        ("ln2", "replicate"),
        ("mlp.0", "column"),
        ("mlp.2", "row"),
    ]
    expected = [
        ("tok", "replicate"),
        ("pos", "replicate"),
        *[(f"blocks.{i}.{name}", kind) for i in range(2) for name, kind in block],
        ("ln_f", "replicate"),
        ("head", "replicate"),
    ]
    assert mpu.plan_autotp(_gpt(), 2) == expected


def tiny_llama() -> nn.Module:
    """A transformers Llama of 2 layers, 4 heads and 2 key/value heads, built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
    )


def test_plan_of_a_transformers_llama() -> None:
    model = tiny_llama()
    layer = [
        ("self_attn.q_proj", "column"),
        ("self_attn.k_proj", "column"),
        ("self_attn.v_proj", "column"),
        ("self_attn.o_proj", "row"),
        ("mlp.gate_proj", "column"),
        ("mlp.up_proj", "column"),
        ("mlp.down_proj", "row"),
        ("input_layernorm", "replicate"),
        ("post_attention_layernorm", "replicate"),
    ]
    expected = [
        ("model.embed_tokens", "replicate"),
        *[(f"model.layers.{i}.{name}", kind) for i in range(2) for name, kind in layer],
        ("model.norm", "replicate"),
        ("lm_head", "replicate"),
    ]
    assert mpu.plan_autotp(model, 2) == expected
    # 2 key/value heads: TP 4 would split one.
    (message,) = _refusal(model, 4)
    assert message == (
        "model.config.num_key_value_heads = 2 attention heads is not divisible by tp_size 4: a rank "
        "would hold part of a head; use a tp_size that divides 2"
    )


def test_transformers_gpt2_conv1d_is_refused_by_name() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )
    (message,) = _refusal(model, 2)
    assert message.startswith(
        "transformer.h.0.attn.c_attn (column_fused_qkv), transformer.h.0.attn.c_proj (row), "
        "transformer.h.0.mlp.c_fc (column) and 5 more: transformers.pytorch_utils.Conv1D "
        "matches sharding rules but AutoTP shards only torch.nn.Linear itself; convert these "
        "layers to nn.Linear"
    )
    assert "rules={'^transformer\\\\.h\\\\.0\\\\.attn\\\\.c_attn$': 'replicate', ...}" in message


# ------------------------------------------------------------------ the user's rules
def test_rules_are_tried_before_the_defaults() -> None:
    plan = dict(mpu.plan_autotp(_gpt(), 2, rules={r"^blocks\.1\.": "replicate", r"^head$": "column", r"^ln_f$": "row"}))
    assert plan["blocks.0.qkv"] == "column_fused_qkv" and plan["blocks.0.mlp.2"] == "row"
    assert {plan[f"blocks.1.{n}"] for n in ("qkv", "proj", "mlp.0", "mlp.2")} == {"replicate"}
    assert plan["head"] == "column"
    assert plan["ln_f"] == "replicate"  # a norm has no weight matrix to split: kept whole
    # An embedding's weight is a matrix, but not a Linear's: refused like a Conv1D.
    (message,) = _refusal(_gpt(), 2, {r"^tok$": "row"})
    assert message.startswith(
        "tok (row): torch.nn.modules.sparse.Embedding matches sharding rules but AutoTP "
        "shards only torch.nn.Linear itself"
    )


def test_rule_problems_are_refused_by_name() -> None:
    assert _refusal(_gpt(), 2, {"qkv$": "colum", "(": "row"}) == [
        "rules: 'qkv$' -> 'colum' is not a kind AutoTP knows; use one of column, column_fused_qkv, row, replicate",
        "rules: '(' is not a valid regular expression (missing ), unterminated subpattern at position 0)",
    ]
    (message,) = _refusal(_gpt(), 2, {r"attn\.q$": "column"})
    assert message == (
        "rules: 'attn\\\\.q$' matches no module that holds parameters; check the name against "
        "model.named_modules() (e.g. tok, pos, blocks.0.ln1, blocks.0.qkv, ...)"
    )


# ------------------------------------------------------------------ refusals
class _Attention(nn.Module):
    def __init__(self, width: int, fused: int, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.o_proj = nn.Linear(8, width), nn.Linear(width, 8)
        self.qkv = nn.Linear(8, fused)


def test_sizes_not_divisible_are_refused_with_the_numbers() -> None:
    fix = "use a tp_size that divides it, or pass rules={'^%s$': 'replicate'}"
    assert _refusal(_Attention(width=6, fused=9), 4) == [
        f"q_proj: out_features 6 is not divisible by tp_size 4 (column); {fix % 'q_proj'}",
        f"o_proj: in_features 6 is not divisible by tp_size 4 (row); {fix % 'o_proj'}",
        f"qkv: out_features 9 is not 3 parts (q, k, v) each divisible by tp_size 4 (column_fused_qkv); {fix % 'qkv'}",
    ]


def test_heads_not_divisible_are_refused_once_per_count() -> None:
    (message,) = _refusal(_gpt(n_heads=3, d_model=24), 2)
    assert message == (
        "blocks.0.n_heads (and 1 more) = 3 attention heads is not divisible by tp_size 2: a rank would "
        "hold part of a head; use a tp_size that divides 3"
    )


def test_fused_qkv_with_fewer_kv_heads_is_refused() -> None:
    model = _Attention(width=8, fused=24)
    model.num_key_value_heads = 2
    (message,) = _refusal(model, 2)
    assert message.startswith("qkv: a fused qkv with 4 query heads and 2 key/value heads is not three equal parts")


def test_tied_sharded_weight_is_refused() -> None:
    model = _gpt()
    model.head.weight = model.tok.weight  # tied, as many language models are
    (message,) = _refusal(model, 2, {"^head$": "column"})
    assert message == (
        "head shares its weight with another module (tied weights); sharding it would untie them: "
        "pass rules={'^head$': 'replicate'}"
    )


def test_plans_that_shard_nothing_or_leave_activations_split_are_refused() -> None:
    (message,) = _refusal(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), 2)
    assert message.startswith("no module matches a sharding rule, so tp_size 2 would shard nothing (modules: 0, 2)")
    (message,) = _refusal(_gpt(), 2, {r"(proj|mlp\.2)$": "replicate"})
    assert message.startswith(
        "the plan has column layers (blocks.0.qkv, blocks.0.mlp.0, blocks.1.qkv) but no row layer"
    )


def test_tp_model_init_at_size_one_and_its_refusals() -> None:
    """Without processes: TP 1 makes the size-1 groups and shards nothing; then every refusal that
    does not need a second rank."""
    model = _gpt()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    try:
        assert engine.tp_model_init(model, 1, dtype=torch.float64) is model
        assert model.ds_autotp_parsed and model.ds_autotp_size == 1
        assert all(torch.equal(p, before[n].double()) for n, p in model.state_dict().items())
        assert type(model.blocks[0].qkv) is nn.Linear
        assert mpu.tp_model_init(model, 1) is model  # again: nothing to do
        with pytest.raises(
            ConfigError,
            match=r"^tp_model_init: the model is already sharded for tp_size 1; it "
            r"cannot be resharded for tp_size 2: build the model again",
        ):
            engine.tp_model_init(model, 2)
        with pytest.raises(
            ConfigError,
            match=r"^tp_model_init\(tp_size=2\) but the tensor-parallel groups already "
            r"have size 1 \(engine.parallel.initialize_model_parallel\); pass "
            r"tp_size 1, or call engine.parallel.destroy_model_parallel\(\) first",
        ):
            engine.tp_model_init(_gpt(), 2)
    finally:
        mpu.destroy_model_parallel()
    with pytest.raises(
        ConfigError,
        match=r"^tp_model_init\(tp_size=1\) but the config's "
        r"tensor_parallel.autotp_size is 2; make them equal",
    ):
        engine.tp_model_init(_gpt(), 1, config={"tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(
        ConfigError,
        match=r"^tp_model_init\(dtype=torch.float16\) but the config trains in "
        r"torch.bfloat16; pass dtype=torch.bfloat16",
    ):
        engine.tp_model_init(_gpt(), 1, torch.float16, config={"bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"^tp_size=0 must be an int >= 1"):
        engine.tp_model_init(_gpt(), 0)
    assert not mpu.model_parallel_is_initialized()


# ------------------------------------------------------------------ sharded == dense, on two processes
def _expected_slice(full: torch.Tensor, dim: int, parts: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of a dense tensor: its 1/tp of each of `parts` equal parts along `dim`."""
    return torch.cat([part.chunk(tp, dim)[rank] for part in full.chunk(parts, dim)], dim)


# (tensor_model_parallel, partition_dim, partition_stride) by the parameter's last two name parts.
LAYOUT = {
    "qkv.weight": (True, 0, 3),
    "qkv.bias": (True, 0, 3),
    "mlp.0.weight": (True, 0, 1),
    "mlp.0.bias": (True, 0, 1),
    "proj.weight": (True, 1, 1),
    "mlp.2.weight": (True, 1, 1),
}


def _sharded_gpt_equals_dense() -> dict[str, Any]:
    torch.manual_seed(3)
    dense = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))
    sharded = engine.tp_model_init(copy.deepcopy(dense), 2)
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(4))  # the same on both TP ranks
    targets = torch.roll(ids, -1, dims=1)
    errors = {"logits": (sharded(ids) - dense(ids)).abs().max().item()}
    loss_dense, loss_sharded = dense(ids, targets), sharded(ids, targets)
    errors["loss"] = (loss_sharded - loss_dense).abs().item()
    loss_dense.backward()
    loss_sharded.backward()
    dense_params = dict(dense.named_parameters())
    layouts = {}
    for name, param in sharded.named_parameters():
        full, grad = dense_params[name], dense_params[name].grad
        assert param.grad is not None and grad is not None
        layout = (
            getattr(param, "tensor_model_parallel", False),
            getattr(param, "partition_dim", -1),
            getattr(param, "partition_stride", 1),
        )
        layouts[name] = layout
        split, dim, parts = layout
        if split:
            full, grad = (_expected_slice(t, dim, parts, tp, rank) for t in (full, grad))
        errors[f"value {name}"] = (param - full).abs().max().item()
        errors[f"grad {name}"] = (param.grad - grad).abs().max().item()
    out = {
        "errors": errors,
        "layouts": layouts,
        "tp": tp,
        "qkv_shape": tuple(sharded.blocks[0].qkv.weight.shape),
        "tp_all_reduces": engine.comm_stats()["calls"].get("tp.all_reduce", 0),
    }
    mpu.destroy_model_parallel()
    return out


def test_autotp_gpt_equals_dense_at_tp2() -> None:
    for rank, r in enumerate(run_distributed(_sharded_gpt_equals_dense, 2)):
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: the AutoTP-sharded GPT differs from the dense one: {bad}"
        assert r["tp"] == 2 and r["qkv_shape"] == (24, 16) and r["tp_all_reduces"] > 0
        for name, layout in r["layouts"].items():
            # Unlisted (a row layer's bias, norms, embeddings, head): replicated on every TP rank.
            expected = next((v for k, v in LAYOUT.items() if name.endswith(k)), (False, -1, 1))
            assert layout == expected, (name, layout)
