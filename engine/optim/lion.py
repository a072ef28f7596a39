"""Lion (Chen et al. 2023), with DeepSpeed FusedLion's parameters: lr, betas, weight_decay.

torch.optim has no Lion, so this small class stands in for DeepSpeed's fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch


class Lion(torch.optim.Optimizer):
    """Per parameter:
    c = beta1 * m + (1 - beta1) * g
    p <- p * (1 - lr * weight_decay) - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

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
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                direction = (m * beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
