"""engine.zero.Init initialises every parameter as the model built without it: transformers 5 models built
from their config under Init (directly, and through transformers' own ZeRO-3 path, HfDeepSpeedConfig +
from_config) equal their unpartitioned twins with the same seed, bitwise, on 2 ranks over gloo.

transformers 5 initialises weights in `post_init` through its own module walk (`initialize_weights` ->
`_initialize_weights` -> `_init_weights`), after Init partitioned every submodule; without Init gathering
those modules for it, every parameter kept its constructor's values (embeddings off by up to 4.1) and
parameters made with `torch.empty` (Mixtral's and Qwen2-MoE's experts) kept uninitialised memory: loss NaN
from the first step (DeepSpeed 0.19.8 does the same). A parameter nothing wrote is refused by name at
initialize, and the Mixtral built under Init trains at stage 3 as the one built without it at stage 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_distributed
from hf_clients import ROOT, client_env, run_script
from models import tiny_hf_config

import engine

SCRIPT = ROOT / "tests" / "hf_scripts" / "zero_init_twins.py"


def test_transformers_models_built_under_init_equal_their_unpartitioned_twins(
    deepspeed_compat: Path, tmp_path: Path
) -> None:
    """Llama, Mixtral, Qwen2-MoE and a model with a raw parameter only _init_weights fills, each built under
    engine.zero.Init and through HfDeepSpeedConfig + from_config (a launch of its own: transformers decides
    whether DeepSpeed is installed when it is imported, and the compat distribution must be there then)."""
    report = tmp_path / "twins.json"
    run_script(SCRIPT, ["--out", str(report)], 2, client_env(deepspeed_compat), tmp_path)
    built = json.loads(report.read_text())
    assert sorted(built) == ["llama", "mixtral", "qwen2_moe", "raw"]
    for name, ways in built.items():
        for way, found in ways.items():
            assert found == {"missing": [], "differ": [], "not_finite": [], "partitioned": True}, (name, way)


# ---------------------------------------------------------------- a parameter nothing wrote
class Unwritten(torch.nn.Module):
    """`raw` is made with torch.empty and nothing writes it; `written` is filled through .data in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = torch.nn.Parameter(torch.empty(6, 4))
        self.written = torch.nn.Parameter(torch.empty(6, 4))
        self.written.data.normal_()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.raw.sum() * self.written.sum()


def _unwritten(stage: int, fix: bool) -> str:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
    }
    with engine.zero.Init():
        model = Unwritten()
    if fix:
        with engine.zero.GatheredParameters(model.raw, modifier_rank=0):
            torch.nn.init.ones_(model.raw)
    try:
        eng, *_ = engine.initialize(model=model, config=config)
    except engine.zero.UnwrittenParameterError as e:
        return str(e)
    eng.destroy()
    return "initialized"


def _unwritten_then_written(stage: int) -> tuple[str, str]:
    return _unwritten(stage, False), _unwritten(stage, True)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_nothing_wrote_is_refused_by_name(stage: int) -> None:
    for message, fixed in run_distributed(_unwritten_then_written, 2, args=(stage,)):
        assert message.startswith("engine.zero.Init: 1 parameter(s) hold values nothing wrote: 'raw'."), message
        assert "engine.zero.GatheredParameters(param, modifier_rank=0)" in message
        assert fixed == "initialized"


# ---------------------------------------------------------------- MoE at stage 3, ranks routing differently
def _moe_losses(name: str, stage: int, under_init: bool) -> dict[str, Any]:
    """3 steps; each rank its own tokens. The losses, and the experts each layer routed this rank's tokens to.
    8 experts, each token to 1: on a rank's 16 tokens some experts get none, and which differs by rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    if under_init:
        with engine.zero.Init(config_dict_or_path=config):
            model = AutoModelForCausalLM.from_config(tiny_hf_config(name, experts=8, top_k=1))
    else:
        model = AutoModelForCausalLM.from_config(tiny_hf_config(name, experts=8, top_k=1))
    eng, *_ = engine.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    losses, routed = [], []
    for step in range(3):
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        out = eng(input_ids=ids, labels=ids, output_router_logits=True)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss))
        routed.append([sorted(set(logits.argmax(-1).tolist())) for logits in out.router_logits])
    eng.destroy()
    return {"losses": losses, "routed": routed}


def _moe_both(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _moe_losses(name, 3, True), _moe_losses(name, 0, False)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_built_under_init_trains_at_stage3_as_without_it_at_stage0(name: str) -> None:
    """The engine gathers whole units, so ranks that route their tokens to different experts never wait on each
    other's gathers (DeepSpeed hangs here without set_z3_leaf_modules). Built under Init and trained at stage 3,
    equal to the model built plainly at stage 0; fp32, the ranks' gradients averaged in another order: 1e-5."""
    init3, plain0 = zip(*run_distributed(_moe_both, 2, args=(name,)))
    assert init3[0]["routed"] != init3[1]["routed"]  # the ranks used different experts
    assert any(len(layer) < 8 for step in init3[0]["routed"] for layer in step)  # and some expert none at all
    for rank, (got, want) in enumerate(zip(init3, plain0)):
        assert all(torch.isfinite(torch.tensor(got["losses"]))), f"rank {rank}: {got['losses']}"
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0, msg=f"{name} rank {rank}")
