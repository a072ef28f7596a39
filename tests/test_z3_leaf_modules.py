"""DeepSpeed's deepspeed.utils leaf-module functions (engine/zero/leaf_modules.py): flags by class, class
name, module name and name suffix, their errors, and what stage 3 makes of a flagged module."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.zero import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Moe(torch.nn.Module):
    """Two experts run in an order that depends on the input: the case leaf modules are for."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([Expert(), Expert()])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.experts if float(x.sum()) > 0 else reversed(self.experts)
        for expert in order:
            x = x + expert(x)
        return self.head(x)


def _model() -> Moe:
    torch.manual_seed(0)
    return Moe()


def test_by_class_by_name_and_by_qualified_name() -> None:
    for wanted in (Expert, "Expert", f"{Expert.__module__}.{Expert.__qualname__}"):
        model = _model()
        assert set_z3_leaf_modules(model, [wanted]) == list(model.experts)
        assert get_z3_leaf_modules(model) == list(model.experts) and z3_leaf_module(model.experts[0])
        assert unset_z3_leaf_modules(model, [wanted]) == list(model.experts)
        assert get_z3_leaf_modules(model) == []


def test_class_errors_name_the_problem() -> None:
    model = _model()
    with pytest.raises(
        TypeError, match=r"set_z3_leaf_modules: leaf_module_classes takes module classes or class names"
    ):
        set_z3_leaf_modules(model, [Expert(), "Expert"])  # an instance, not its class
    assert get_z3_leaf_modules(model) == []  # nothing flagged by a refused call
    with pytest.raises(ValueError, match=r"no submodule of Moe is of the classes \['Router'\]"):
        set_z3_leaf_modules(model, ["Router"])
    assert set_z3_leaf_modules(model, ["Router"], raise_if_not_found=False) == []


def test_by_module_name_and_by_suffix() -> None:
    model = _model()
    found, missing = set_z3_leaf_modules_by_name(model, ["experts.1", "experts.7"], raise_if_not_found=False)
    assert found == [model.experts[1]] and missing == ["experts.7"]
    with pytest.raises(ValueError, match=r"has no module named \['experts.7'\]"):
        set_z3_leaf_modules_by_name(model, ["experts.7"])
    found, missing = set_z3_leaf_modules_by_name(model, ["experts.1"], flag=False)
    assert found == [model.experts[1]] and not z3_leaf_module(model.experts[1])

    found, missing = set_z3_leaf_modules_by_suffix(model, ["up", "experts.0.up", "gate"], raise_if_not_found=False)
    assert found == [model.experts[0].up, model.experts[1].up] and missing == ["gate"]  # each module once
    with pytest.raises(ValueError, match=r"no module name of Moe ends with \['gate'\]"):
        set_z3_leaf_modules_by_suffix(model, ["gate"])
    set_z3_leaf_module(model.experts[0].up, False)
    assert get_z3_leaf_modules(model) == [model.experts[1].up]


def _train(flag_by: str) -> tuple[list[float], bool]:
    model = _model()
    if flag_by == "class":
        set_z3_leaf_modules(model, [Expert])
    elif flag_by == "name":
        set_z3_leaf_modules_by_name(model, ["experts.0", "experts.1"])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    eng, *_ = engine.initialize(model=model, config=config)
    try:
        marked = all(z3_leaf_parameter(p) and p.ds_z3_leaf_module is e for e in model.experts for p in e.parameters())
        torch.manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(4, 8) * (1 if len(losses) % 2 else -1)  # the experts' order changes every step
            loss = eng(x).square().mean()
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
        return losses, marked
    finally:
        eng.destroy()


def test_stage3_marks_the_flagged_modules_parameters_and_trains_the_same() -> None:
    by_class, marked_class = _train("class")
    by_name, marked_name = _train("name")
    plain, marked_plain = _train("none")
    assert marked_class and marked_name and not marked_plain
    assert by_class == by_name  # the same units, whichever way they were named
    assert by_class == pytest.approx(plain, rel=1e-5)  # units change where parameters are gathered, not the math
