"""fp16.auto_cast (refused before): the engine's forward casts floating positional inputs to fp16, as
DeepSpeed does, so a loop that builds fp32 batches trains an fp16 model exactly as one casting by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine
from tests.distributed import run_distributed


class Recorder(torch.nn.Module):
    """A linear model that notes the dtypes it was given: positional pair, nested dict, keyword, ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.seen: list[tuple[str, ...]] = []

    def forward(
        self,
        pair: tuple[torch.Tensor, torch.Tensor],
        extra: dict[str, torch.Tensor],
        ids: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.seen.append((str(pair[0].dtype), str(extra["x"].dtype), str(ids.dtype), str(scale.dtype)))
        out = self.linear(pair[0] + extra["x"]) + pair[1]
        return out * scale.to(out.dtype) + ids.to(out.dtype).mean()


def _train(auto_cast: bool, stage: int) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "auto_cast": auto_cast, "initial_scale_power": 8},
    }
    model = Recorder()
    eng, _, _, _ = engine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    try:
        for _ in range(3):
            x, y, b = (torch.randn(4, 8, generator=g) for _ in range(3))
            ids = torch.randint(0, 5, (4,), generator=g)
            if not auto_cast:  # the loop DeepSpeed users write without auto_cast
                x, y, b = x.half(), y.half(), b.half()
            loss = eng((x, b), {"x": y}, ids, scale=torch.full((8,), 0.5)).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
        return {"seen": model.seen, "state": {k: v.float().clone() for k, v in eng.consolidated_state_dict().items()}}
    finally:
        eng.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_auto_cast_casts_positional_floats_and_trains_as_casting_by_hand(stage: int) -> None:
    cast = run_distributed(_train, 2, args=(True, stage))[0]
    by_hand = run_distributed(_train, 2, args=(False, stage))[0]
    # Positional floats (also inside a tuple and a dict) arrive fp16; ids stay int64; the keyword input
    # is not cast (DeepSpeed casts positional inputs only).
    assert set(cast["seen"]) == {("torch.float16", "torch.float16", "torch.int64", "torch.float32")}, cast["seen"]
    for k, v in by_hand["state"].items():
        assert torch.equal(cast["state"][k], v), k
