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

from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import Unpack

from engine.optim.adam import AdamHyper, adam_defaults, adam_direction
from engine.optim.per_tensor import PerTensorOptimizer


class Lamb(PerTensorOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        *,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        **hyper: Unpack[AdamHyper],
    ) -> None:
        """FusedLamb's arguments; `hyper`: lr, betas, eps, weight_decay (AdamHyper), each defaulting to
        ADAM_DEFAULTS' (FusedLamb's defaults too)."""
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = adam_defaults(
            type(self).__name__,
            hyper,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []
        """Trust ratio of every tensor updated by the last step (FusedLamb's get_lamb_coeffs)."""

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    def _begin_step(self) -> None:
        self.lamb_coeffs = []

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Apply one LAMB step to `p`; record the trust ratio used in lamb_coeffs."""
        # Phases 1-2: the Adam direction from the raw gradient, plus decoupled weight decay (uses p
        # before the update).
        update = adam_direction(state, grad, group, eps_inside_sqrt=group["eps_inside_sqrt"])
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])

        # Phase 3: layer-wise trust ratio, clamped as FusedLamb does. See [Note: FusedLamb semantics].
        w_norm = p.norm().item()
        u_norm = update.norm().item()
        coeff = 1.0
        if w_norm != 0.0 and u_norm != 0.0:
            coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])

        p.add_(update, alpha=-group["lr"] * coeff)
        self.lamb_coeffs.append(coeff)
