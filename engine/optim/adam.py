"""A plain, readable Adam with DeepSpeed FusedAdam's `bias_correction` switch.

torch.optim.Adam/AdamW always bias-correct, so `"bias_correction": false` cannot be expressed
with them; this class is used only for that case. With bias_correction=True it matches
torch.optim.AdamW (adam_w_mode=True) or torch.optim.Adam (adam_w_mode=False); the tests check
that, which also makes it the naive reference path for Adam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch


class ReferenceAdam(torch.optim.Optimizer):
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
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "bias_correction": bias_correction,
        }
        super().__init__(params, defaults)

    # torch.optim.Optimizer's overloads: the closure's loss when given one, else None.
    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
                bc2 = 1 - beta2**t if group["bias_correction"] else 1.0

                grad = p.grad
                if not group["adam_w_mode"] and decay != 0:
                    grad = grad.add(p, alpha=decay)  # L2: the decay goes through the moments
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

                update = (m / bc1) / ((v / bc2).sqrt_().add_(eps))
                if group["adam_w_mode"] and decay != 0:
                    update.add_(p, alpha=decay)  # decoupled: decay bypasses the moments
                p.add_(update, alpha=-lr)
        return loss
