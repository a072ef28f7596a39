"""Lion (Chen et al. 2023), with DeepSpeed FusedLion's parameters: lr, betas, weight_decay.

torch.optim has no Lion, so this small class stands in for DeepSpeed's fused kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engine.optim.per_tensor import PerTensorOptimizer


class Lion(PerTensorOptimizer):
    """Per parameter:
    c = beta1 * m + (1 - beta1) * g
    p <- p * (1 - lr * weight_decay) - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g
    """

    state_tensors = ("exp_avg",)
    counts_steps = False  # the update does not depend on t (no bias correction)
    sparse_grads = True  # every operation on g takes a sparse tensor, and adds it into a dense one

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        direction = (m * beta1).add_(grad, alpha=1 - beta1).sign_()
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
        m.mul_(beta2).add_(grad, alpha=1 - beta2)
