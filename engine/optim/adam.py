"""Adam's hyper-parameters and moment math, defined once, and a plain, readable Adam with DeepSpeed
FusedAdam's `bias_correction` switch.

torch.optim.Adam/AdamW always bias-correct, so `"bias_correction": false` cannot be expressed
with them; ReferenceAdam is used only for that case. With bias_correction=True it matches
torch.optim.AdamW (adam_w_mode=True) or torch.optim.Adam (adam_w_mode=False); the tests check
that, which also makes it the naive reference path for Adam. Lamb shares the hyper-parameters
(`AdamHyper`, `ADAM_DEFAULTS`) and the bias-corrected direction (`adam_direction`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack

from engine.optim.per_tensor import PerTensorOptimizer


class AdamHyper(TypedDict, total=False):
    """The hyper-parameters of every Adam-like optimizer here; a missing one takes ADAM_DEFAULTS'."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


ADAM_DEFAULTS: AdamHyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
"""DeepSpeed FusedAdam's (and FusedLamb's) defaults. weight_decay is 0, not torch.optim.AdamW's 0.01,
so the same JSON decays the same amount here and in DeepSpeed."""


def adam_defaults(owner: str, hyper: AdamHyper, **switches: Any) -> dict[str, Any]:
    """`owner`'s `defaults`: `hyper` over ADAM_DEFAULTS (betas made a tuple), then `switches`."""
    # **hyper is typed for mypy only: at run time a misspelt keyword lands in it, so refuse it here
    # with the TypeError an explicit signature would raise.
    for name in hyper:
        if name not in ADAM_DEFAULTS:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    merged: dict[str, Any] = {**ADAM_DEFAULTS, **hyper}
    return {**merged, "betas": tuple(merged["betas"]), **switches}


def adam_direction(
    state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any], *, eps_inside_sqrt: bool = False
) -> torch.Tensor:
    """Advance the moments in `state` by `grad`; return m_hat / (sqrt(v_hat) + eps), a new tensor.

    m_hat, v_hat = m / bc1, v / bc2 with bc_i = 1 - beta_i^t, or 1 without group["bias_correction"];
    eps_inside_sqrt gives sqrt(v_hat + eps) instead (FusedLamb's switch).
    """
    beta1, beta2 = group["betas"]
    t = state["step"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
    bc2 = 1 - beta2**t if group["bias_correction"] else 1.0
    v_hat = v / bc2
    denom = v_hat.add_(group["eps"]).sqrt_() if eps_inside_sqrt else v_hat.sqrt_().add_(group["eps"])
    return (m / bc1).div_(denom)


class ReferenceAdam(PerTensorOptimizer):
    """Adam as DeepSpeed's FusedAdam computes it, one tensor at a time.

    Per parameter, with g the gradient and t the step count:
        adam_w_mode=False (L2):  g <- g + weight_decay * p
        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g^2
        m_hat, v_hat = m / bc1, v / bc2   (bc_i = 1 - beta_i^t, or 1 without bias_correction)
        update = m_hat / (sqrt(v_hat) + eps)  [+ weight_decay * p when adam_w_mode=True]
        p <- p - lr * update
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        adam_w_mode: bool = True,
        bias_correction: bool = True,
        **hyper: Unpack[AdamHyper],
    ) -> None:
        """`hyper`: lr, betas, eps, weight_decay (AdamHyper), each defaulting to ADAM_DEFAULTS'."""
        defaults = adam_defaults(type(self).__name__, hyper, adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        decay = group["weight_decay"]
        if not group["adam_w_mode"] and decay != 0:
            grad = grad.add(p, alpha=decay)  # L2: the decay goes through the moments
        update = adam_direction(state, grad, group)
        if group["adam_w_mode"] and decay != 0:
            update.add_(p, alpha=decay)  # decoupled: decay bypasses the moments
        p.add_(update, alpha=-group["lr"])
