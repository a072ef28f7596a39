"""LAMB with DeepSpeed FusedLamb's semantics, in plain torch.

[Note: FusedLamb semantics we match]
- The trust ratio is computed per parameter tensor (FusedLamb launches its kernel once per
  tensor), not per group and not over the whole model.
- Adam moments are bias-corrected themselves (m_hat, v_hat), not through the step size, so the
  trust-ratio-normalised update is the paper's (LAMB Algorithm 2).
- eps is added outside the square root unless eps_inside_sqrt=True.
- Weight decay is added to the update before the trust ratio (decoupled from the moments).
- trust ratio = ||p|| / ||update||, clamped to [min_coeff, max_coeff]; 1.0 when either norm is 0,
  so freshly zero-initialised tensors (biases) still move.
- FusedLamb's max_grad_norm and grad scale arguments are not supported: the engine clips with
  `gradient_clipping` and unscales before the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []
        """Trust ratio of every tensor updated by the last step (FusedLamb's get_lamb_coeffs)."""

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

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
        self.lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self.lamb_coeffs.append(self._update_one(p, group))
        return loss

    def _update_one(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        """Apply one LAMB step to `p`; return the trust ratio used."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        t = state["step"]

        # Phase 1: Adam moments from the raw gradient.
        grad = p.grad
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        # Phase 2: the Adam direction plus decoupled weight decay (uses p before the update).
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        bc2 = 1 - beta2**t if group["bias_correction"] else 1.0
        v_hat = v / bc2
        denom = (
            (v_hat + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v_hat.sqrt_().add_(group["eps"])
        )
        update = (m / bc1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])

        # Phase 3: layer-wise trust ratio, clamped as FusedLamb does. See [Note: FusedLamb semantics].
        w_norm = p.norm().item()
        u_norm = update.norm().item()
        coeff = 1.0
        if w_norm != 0.0 and u_norm != 0.0:
            coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])

        p.add_(update, alpha=-group["lr"] * coeff)
        return coeff
