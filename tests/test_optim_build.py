"""build_optimizer: DeepSpeed names -> classes, refusals, parity with torch, caller param groups."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.config.errors import ConfigError
from engine.config.types import OptimizerConfig
from engine.optim import Lamb, Lion, ReferenceAdam, build_optimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(7, 3, generator=g)),
        torch.nn.Parameter(torch.randn(5, generator=g)),
    ]


def _build(name: str, params: dict[str, Any] | None = None, groups: list[dict[str, Any]] | None = None):
    return build_optimizer(OptimizerConfig(name, params or {}), groups or [{"params": _params()}])


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, params, cls",
    [
        ("Adam", {}, torch.optim.AdamW),  # DeepSpeed's Adam is decoupled-decay by default
        ("adam", {}, torch.optim.AdamW),
        ("ADAM", {"adam_w_mode": True}, torch.optim.AdamW),
        ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {}, torch.optim.AdamW),
        ("adamw", {"adam_w_mode": False}, torch.optim.AdamW),  # the AdamW name forces AdamW, as in DeepSpeed
        ("Adam", {"bias_correction": False}, ReferenceAdam),
        ("SGD", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD),
        ("sgd", {"lr": 0.1}, torch.optim.SGD),
        ("Adagrad", {"lr": 0.1}, torch.optim.Adagrad),
        ("Lamb", {}, Lamb),
        ("LAMB", {"max_coeff": 0.3}, Lamb),
        ("Lion", {}, Lion),
        ("RMSprop", {"lr": 0.01, "alpha": 0.9}, torch.optim.RMSprop),
        ("rmsprop", {}, torch.optim.RMSprop),
        ("NAdam", {}, torch.optim.NAdam),
    ],
)
def test_name_maps_to_class(name: str, params: dict[str, Any], cls: type) -> None:
    assert type(_build(name, params)) is cls


def test_adam_defaults_are_deepspeeds() -> None:
    opt = _build("Adam")
    d = opt.defaults
    # weight_decay 0 is FusedAdam's default; torch.optim.AdamW's own default would be 0.01.
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)


def test_params_reach_the_optimizer() -> None:
    opt = _build("Adam", {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True})
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)
    lamb = _build("Lamb", {"lr": 0.01, "max_coeff": 0.3, "min_coeff": 0.02, "bias_correction": False})
    assert (lamb.defaults["max_coeff"], lamb.defaults["min_coeff"], lamb.defaults["bias_correction"]) == (
        0.3,
        0.02,
        False,
    )
    sgd = _build("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": False})
    assert (sgd.defaults["momentum"], sgd.defaults["dampening"], sgd.defaults["weight_decay"]) == (
        0.9,
        0.1,
        0.01,
    )


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "onebitadam"])
def test_compressed_comm_optimizers_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="not supported") as info:
        _build(name)
    assert name.lower() in str(info.value).lower()


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Lamb"])
def test_amsgrad_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.amsgrad"):
        _build(name, {"amsgrad": True})


def test_amsgrad_false_accepted() -> None:
    assert type(_build("Adam", {"amsgrad": False})) is torch.optim.AdamW


@pytest.mark.parametrize("name", ["Adam", "Lamb", "SGD"])
def test_max_grad_norm_points_to_gradient_clipping(name: str) -> None:
    with pytest.raises(ConfigError, match="gradient_clipping") as info:
        _build(name, {"lr": 0.1, "max_grad_norm": 1.0})
    assert "optimizer.params.max_grad_norm" in str(info.value)


@pytest.mark.parametrize("name, suggestion", [("Adamm", "Adam"), ("lam", "Lamb"), ("RMSProps", "RMSprop")])
def test_unknown_name_suggests_closest(name: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f'Did you mean "{suggestion}"'):
        _build(name)


def test_unknown_param_names_key_and_accepted_names() -> None:
    with pytest.raises(ConfigError) as info:
        _build("Adam", {"lrr": 0.1, "beta": [0.9, 0.99]})
    msg = str(info.value)
    assert "optimizer.params.lrr" in msg and 'Did you mean "lr"' in msg
    assert "optimizer.params.beta" in msg and 'Did you mean "betas"' in msg
    assert "Accepted: adam_w_mode, amsgrad, betas" in msg
    assert "2 problems" in msg


def test_unknown_param_for_torch_class() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.momentumm .*torch\.optim\.RMSprop.*momentum"):
        _build("RMSprop", {"momentumm": 0.9})


@pytest.mark.parametrize(
    "name, params",
    [
        ("Adam", {"lr": -1.0}),
        ("Adam", {"betas": [0.9]}),
        ("Adam", {"betas": [0.9, 1.5]}),
        ("SGD", {"lr": -0.1}),
        ("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0}),
        ("Adam", {"adam_w_mode": "yes"}),
    ],
)
def test_bad_values_are_config_errors(name: str, params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params"):
        _build(name, params)


# -- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_adam_matches_torch(adam_w_mode: bool, reference: type) -> None:
    hp = {"lr": 1e-2, "betas": (0.85, 0.99), "eps": 1e-7, "weight_decay": 0.1}
    ours_p, ref_p = _params(), _params()
    ours = build_optimizer(
        OptimizerConfig("Adam", {**hp, "betas": list(hp["betas"]), "adam_w_mode": adam_w_mode}),
        [{"params": ours_p}],
    )
    ref = reference(ref_p, **hp)
    _run(ours, ours_p, 15)
    _run(ref, ref_p, 15)
    for a, b in zip(ours_p, ref_p):
        # foreach is bit-identical to torch's per-tensor loop on CPU.
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adam_w_mode_changes_the_result() -> None:
    # Guards the test above: with weight decay, L2 and decoupled decay must differ.
    a_p, b_p = _params(), _params()
    a = _build("Adam", {"weight_decay": 0.5, "lr": 0.1, "adam_w_mode": True}, [{"params": a_p}])
    b = _build("Adam", {"weight_decay": 0.5, "lr": 0.1, "adam_w_mode": False}, [{"params": b_p}])
    _run(a, a_p, 5)
    _run(b, b_p, 5)
    assert not torch.allclose(a_p[0], b_p[0])


@pytest.mark.parametrize("adam_w_mode, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_reference_adam_with_bias_correction_matches_torch(adam_w_mode: bool, reference: type) -> None:
    ours_p, ref_p = _params(), _params()
    ours = ReferenceAdam(ours_p, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref = reference(ref_p, lr=1e-2, weight_decay=0.1)
    _run(ours, ours_p, 15)
    _run(ref, ref_p, 15)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction(adam_w_mode: bool) -> None:
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.999, 1e-8, 0.1
    opt = _build(
        "Adam",
        {"lr": lr, "weight_decay": wd, "bias_correction": False, "adam_w_mode": adam_w_mode},
        [{"params": (ps := [torch.nn.Parameter(torch.tensor([1.0, -2.0]))])}],
    )
    # Scalar reference of FusedAdam without bias correction: m and v are used as they are.
    p, m, v = [1.0, -2.0], [0.0, 0.0], [0.0, 0.0]
    for grad in ([0.5, 0.25], [-1.0, 0.5], [0.1, 0.1]):
        ps[0].grad = torch.tensor(grad)
        opt.step()
        for i in range(2):
            g = grad[i] + (0.0 if adam_w_mode else wd * p[i])
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = m[i] / (math.sqrt(v[i]) + eps) + (wd * p[i] if adam_w_mode else 0.0)
            p[i] -= lr * update
    torch.testing.assert_close(ps[0].detach(), torch.tensor(p), rtol=1e-6, atol=1e-7)


# -- caller param groups -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Lamb", "Adagrad", "Lion"])
def test_caller_param_groups_keep_their_values(name: str) -> None:
    a, b, c = _params(0), _params(1), _params(2)
    groups = [
        {"params": a, "lr": 0.5},
        {"params": b, "weight_decay": 0.0},  # typical "no decay for biases/norms" group
        {"params": c},
    ]
    opt = build_optimizer(OptimizerConfig(name, {"lr": 0.01, "weight_decay": 0.2}), groups)
    got = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert got == [(0.5, 0.2), (0.01, 0.0), (0.01, 0.2)]
