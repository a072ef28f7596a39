"""zero_optimization.ignore_unused_parameters: DeepSpeed's default (true) trains a parameter that took no
part in the loss with a zero gradient; false refuses the step at stages 1-2 (where DeepSpeed reads the
key), naming the parameter and the ranks where it got no gradient, on every rank, before anything changes.
Real processes over gloo, 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed

import engine
from engine.zero import safe_get_full_fp32_param


class Branchy(torch.nn.Module):
    """`spare` is used only on the ranks listed in `uses_spare` (an expert some ranks' tokens miss)."""

    def __init__(self, uses_spare: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)
        self.uses_spare = uses_spare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if torch.distributed.get_rank() in self.uses_spare:
            y = y + self.spare(x)
        return y


def _step(stage: int, ignore: bool | None, uses_spare: tuple[int, ...]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if ignore is not None:
        zero["ignore_unused_parameters"] = ignore
    model = Branchy(uses_spare)
    eng, *_ = engine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": zero,
        },
    )
    named = dict(model.named_parameters())
    before = {n: safe_get_full_fp32_param(p) for n, p in named.items()}  # stage 3: its partitions, gathered
    eng.backward(eng(torch.ones(2, 8)).square().mean())
    try:
        eng.step()
        error = ""
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    changed = {n: not torch.equal(before[n], safe_get_full_fp32_param(p)) for n, p in named.items()}
    eng.destroy()
    return {"error": error, "changed": changed}


@pytest.mark.parametrize("stage", [1, 2])
def test_false_refuses_a_step_with_an_unused_parameter(stage: int) -> None:
    for out in run_distributed(_step, 2, args=(stage, False, (0,))):  # rank 1 never uses `spare`
        assert out["error"].startswith("UnusedParametersError"), out["error"]
        assert "'spare.weight' (ranks [1])" in out["error"] and "'spare.bias' (ranks [1])" in out["error"]
        assert "body" not in out["error"]
        assert not any(out["changed"].values()), out["changed"]  # refused before anything changed


@pytest.mark.parametrize(
    "stage, ignore, uses_spare", [(2, None, ()), (1, True, ()), (0, False, ()), (3, False, ()), (2, False, (0, 1))]
)
def test_trains_otherwise(stage: int, ignore: bool | None, uses_spare: tuple[int, ...]) -> None:
    """The default, true, stages 0 and 3 (DeepSpeed does not read the key there), or every parameter used."""
    for out in run_distributed(_step, 2, args=(stage, ignore, uses_spare)):
        assert out["error"] == ""
        assert out["changed"]["body.weight"]
