"""The step and the hyper-parameter checks ReferenceAdam, Lamb and Lion share (engine/optim/per_tensor.py):
the same closure, skipping and state behaviour for all three, one check of lr/betas/eps/weight_decay,
and one refusal of sparse gradients (Lion alone takes them)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from engine.optim import Lamb, Lion, ReferenceAdam
from engine.optim.per_tensor import PerTensorOptimizer

OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any], tuple[str, ...]]] = [
    (ReferenceAdam, {"lr": 1e-2}, ("step", "exp_avg", "exp_avg_sq")),
    (Lamb, {"lr": 1e-2}, ("step", "exp_avg", "exp_avg_sq")),
    (Lion, {"lr": 1e-3}, ("exp_avg",)),
]


@pytest.mark.parametrize("cls,kwargs,state_keys", OPTIMIZERS, ids=[c.__name__ for c, _, _ in OPTIMIZERS])
def test_shared_step(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], state_keys: tuple[str, ...]) -> None:
    # The closure's loss comes back (computed with grad enabled); a parameter without a gradient is
    # neither changed nor given state; the others get their class's state, step counted from 1.
    torch.manual_seed(0)
    used, unused = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(2))
    before = unused.detach().clone()
    opt = cls([used, unused], **kwargs)

    losses: list[float] = []

    def closure() -> float:
        opt.zero_grad()
        loss = (used**2).sum()
        loss.backward()  # needs grad enabled although step() runs under no_grad
        losses.append(loss.item())
        return losses[-1]

    assert opt.step(closure) == losses[0]
    assert opt.step(closure) == losses[1] != losses[0]
    assert torch.equal(unused, before) and unused not in opt.state
    assert tuple(opt.state[used]) == state_keys
    if "step" in state_keys:
        assert opt.state[used]["step"] == 2
    assert opt.step() is None


def test_classes_share_one_step() -> None:
    # One definition of the step: none of the three carries its own copy. (torch.optim.Optimizer
    # wraps a class's step in a profiling hook at its first instance, hence the unwrap.)
    shared = inspect.unwrap(PerTensorOptimizer.step)
    for cls in (ReferenceAdam, Lamb, Lion):
        assert issubclass(cls, PerTensorOptimizer)
        assert inspect.unwrap(cls.step) is shared, cls.__name__


@pytest.mark.parametrize("cls", [ReferenceAdam, Lamb, Lion])
@pytest.mark.parametrize(
    "bad,named",
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (-0.1, 0.9)}, "betas"),
    ],
)
def test_bad_hyper_parameters_refused(cls: type[torch.optim.Optimizer], bad: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}: {named} must be"):
        cls([torch.nn.Parameter(torch.zeros(2))], **bad)


@pytest.mark.parametrize("cls", [ReferenceAdam, Lamb])
def test_bad_eps_refused(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}: eps must be finite and >= 0, got -1e-08"):
        cls([torch.nn.Parameter(torch.zeros(2))], eps=-1e-8)


@pytest.mark.parametrize("cls", [ReferenceAdam, Lamb])
def test_misspelt_keyword_refused(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_decy'"):
        cls([torch.nn.Parameter(torch.zeros(2))], weight_decy=0.1)


def _sparse_step(cls: type[torch.optim.Optimizer], sparse: bool) -> torch.Tensor:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3, sparse=sparse)
    opt = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 3, 1])).sum().backward()
    opt.step()
    return emb.weight.detach()


@pytest.mark.parametrize("cls", [ReferenceAdam, Lamb])
def test_sparse_gradients_refused_by_name(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        _sparse_step(cls, sparse=True)


def test_lion_steps_sparse_gradients_as_dense() -> None:
    assert torch.equal(_sparse_step(Lion, sparse=True), _sparse_step(Lion, sparse=False))
