"""TRL's generation gather at ZeRO-3 (ds3_gather_for_generation=True, its default for GRPO, RLOO, online DPO),
with TRL's own functions: trl.models.utils.unwrap_model_for_generation does, on every rank,

    with deepspeed.zero.GatheredParameters(model.parameters()):
        remove_hooks(model); ...generate...; add_hooks(model)

remove_hooks/add_hooks reach the engine's stage-3 hooks through `optimizer.parameter_offload`
(engine/zero/stage3/parameter_offload.py). Here they run between training steps of a Llama at stage 3 on 2 ranks
over gloo: the generation makes no all-gather at all (every unit was gathered once, on entry), generates what the
model generates gathered layer by layer (the hooks' way, ds3_gather_for_generation=False), and training afterwards
is bitwise the run that never generated.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed import run_distributed
from models import tiny_hf_config

import engine
from engine import comm


def _model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_hf_config(pad_token_id=0, eos_token_id=1))


def _generate(eng: Any, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return eng.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)


def _train(generation: str) -> dict[str, Any]:
    """3 steps at stage 3; after each, `generation`: "none", "trl_gather" (TRL's default) or "per_layer"."""
    from trl.models.utils import add_hooks, remove_hooks

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    eng, *_ = engine.initialize(model=_model(), config=config)
    rank = torch.distributed.get_rank()
    prompt = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(50 + rank))
    losses, generated, gathers = [], [], []
    for step in range(3):
        ids = torch.randint(2, 96, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
        if generation == "trl_gather":
            with engine.zero.GatheredParameters(eng.parameters()):
                remove_hooks(eng)
                before = comm.comm_stats()["calls"].get("all_gather", 0)
                generated.append(_generate(eng, prompt))
                gathers.append(comm.comm_stats()["calls"].get("all_gather", 0) - before)
                add_hooks(eng)
        elif generation == "per_layer":
            before = comm.comm_stats()["calls"].get("all_gather", 0)
            generated.append(_generate(eng, prompt))
            gathers.append(comm.comm_stats()["calls"].get("all_gather", 0) - before)
    offload = eng.optimizer.parameter_offload
    state = {
        "hooks": (len(offload.forward_hooks), len(offload.backward_hooks)),
        "trace_invalid": offload.param_coordinator.is_invalid_trace(),
        "one_coordinator": offload.get_param_coordinator(training=True) is offload.param_coordinator,
    }
    eng.destroy()
    return {"losses": losses, "generated": generated, "gathers": gathers, **state}


def _three_ways() -> list[dict[str, Any]]:
    return [_train(generation) for generation in ("none", "trl_gather", "per_layer")]


def test_trl_generation_gather_at_stage3_gathers_once_and_training_is_unchanged() -> None:
    plain, trl_gather, per_layer = zip(*run_distributed(_three_ways, 2))
    for rank in range(2):
        where = f"rank {rank}"
        assert trl_gather[rank]["losses"] == plain[rank]["losses"], where  # bitwise: generation changed nothing
        assert per_layer[rank]["losses"] == plain[rank]["losses"], where
        assert trl_gather[rank]["gathers"] == [0, 0, 0], where  # the hooks were off: no gather while generating
        assert min(per_layer[rank]["gathers"]) > 0, where  # with them, each forward gathers layer by layer
        for got, want in zip(trl_gather[rank]["generated"], per_layer[rank]["generated"]):
            assert got.shape[1] > 5 and torch.equal(got, want), where
        assert trl_gather[rank]["hooks"] == plain[rank]["hooks"], where  # add_hooks put every hook back, once
        assert trl_gather[rank]["hooks"][0] > 0 and trl_gather[rank]["hooks"][1] > 0, where
        # add_hooks invalidated the recorded order of unit uses (nothing trained since); training records one
        assert trl_gather[rank]["trace_invalid"] and not plain[rank]["trace_invalid"], where
        assert plain[rank]["one_coordinator"], where  # get_param_coordinator(training=True), as LoRA code calls it
