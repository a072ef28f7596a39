"""The part of `step()` that the engine's plain-torch optimizers (ReferenceAdam, Lamb, Lion) share.

Each of them updates one parameter tensor at a time from its gradient and its own state. This base
does the rest once: the closure, the walk over param groups, skipping parameters without a gradient,
refusing sparse gradients, creating and counting the state, and checking the hyper-parameters every
subclass has (lr, betas, eps, weight_decay) when the optimizer is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, overload

import torch


class PerTensorOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose subclasses implement `_update` for one parameter."""

    state_tensors: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    """The state tensors each parameter gets, zeros shaped like it, created at its first update."""
    counts_steps: ClassVar[bool] = True
    """Whether the state holds `step`, the number of updates including the current one (an int)."""
    sparse_grads: ClassVar[bool] = False
    """Whether `_update` is correct for a sparse gradient; when not, step() refuses one by name."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        check_hyper(type(self).__name__, defaults)
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Update `p` in place from `grad`, with its `state` (created, step counted) and its `group`."""
        raise NotImplementedError

    def _begin_step(self) -> None:
        """Called once per step before any `_update` (for per-step bookkeeping)."""

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
        self._begin_step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse and not self.sparse_grads:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, p.grad, self._counted_state(p), group)
        return loss

    def _counted_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if self.counts_steps:
                state["step"] = 0
            for name in self.state_tensors:
                state[name] = torch.zeros_like(p)
        if self.counts_steps:
            state["step"] += 1
        return state


def check_hyper(owner: str, hyper: Mapping[str, Any]) -> None:
    """ValueError (torch.optim's convention; the config builder turns it into a ConfigError) for an
    lr, eps or weight_decay that is negative or not finite, or betas outside [0, 1); absent keys pass."""
    for name in ("lr", "eps", "weight_decay"):
        if name in hyper and not (math.isfinite(hyper[name]) and hyper[name] >= 0.0):
            raise ValueError(f"{owner}: {name} must be finite and >= 0, got {hyper[name]!r}")
    if "betas" in hyper:
        betas = hyper["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{owner}: betas must be two numbers in [0, 1), got {betas!r}")
