"""The optimizer `engine.initialize` returns: DeepSpeed's ZeRO optimizer as a training loop sees it.

DeepSpeed hands back its own optimizer object, not the torch one it was given, and loops rely on
two of its behaviours that a plain torch optimizer does not have once an engine owns it:

* `zero_grad()` is always safe. Gradients belong to the engine: they accumulate over a window of
  gradient_accumulation_steps micro-steps and the step at the window's boundary zeroes them. So
  zero_grad() only releases the parameters' `.grad` references (torch's set_to_none) and never
  discards what the engine accumulated: Lightning calls it at every window start, hand-written
  loops call it before every backward, and neither may lose or unbind a gradient. (DeepSpeed's
  ZeRO-2/3 keep their partitioned gradients through zero_grad in the same way.) To drop a window's
  gradients on purpose, call engine.zero_grad().
* `step()` takes the whole ZeRO step: reduce what is not reduced yet, unscale, clip, update the
  masters, gather the partitions, zero the gradients, step the LR schedule and the counters, as
  engine.step() does at a boundary (Lightning Fabric calls optimizer.step() instead of engine.step()).

Everything else (param_groups, state, defaults, state_dict, hooks) is the wrapped optimizer's, so a
scheduler built on this object and one built on the original drive the same learning rates.
It subclasses torch.optim.Optimizer without running its constructor: the wrapped optimizer holds
all the state, and `isinstance(opt, torch.optim.Optimizer)` (LR schedulers, Lightning) holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.runtime.engine import Engine


class DeepSpeedOptimizer:
    """DeepSpeed's base class of the optimizers its engine returns (runtime/base_optimizer.py, an empty
    class there too): code written for DeepSpeed recognises the returned optimizer with
    `isinstance(opt, DeepSpeedOptimizer)` (Lightning Fabric does, deciding whether a checkpoint's state
    asks for optimizer states). `deepspeed.runtime.base_optimizer.DeepSpeedOptimizer` is this class."""


class ZeroOptimizer(torch.optim.Optimizer, DeepSpeedOptimizer):
    """See the module docstring. `optimizer` is the torch optimizer stepping the fp32 masters
    (DeepSpeed's name for it on its ZeRO optimizers)."""

    def __init__(self, engine: Engine, optimizer: torch.optim.Optimizer) -> None:
        # No super().__init__(): param_groups, state and defaults are the wrapped optimizer's (below).
        self.optimizer = optimizer
        self._engine = weakref.ref(engine)  # the engine holds this object; no cycle keeps either alive
        self.overflow = False
        """DeepSpeed's: was the last step skipped (fp16 overflow, a non-finite gradient norm)?"""

    # ---------------------------------------------------------------- the wrapped optimizer's state
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "add_param_group() on the engine's optimizer: the engine laid out (and partitioned) "
            "every parameter at engine.initialize(), so groups cannot be added afterwards; pass "
            "all parameter groups to the optimizer before engine.initialize()"
        )

    @property
    def parameter_offload(self) -> Any:
        """DeepSpeed's stage-3 optimizer keeps its module hooks here; TRL's generation removes and re-adds
        them through it (engine/zero/stage3/parameter_offload.py). At stages 0-2 absent, as on DeepSpeed's
        stage 1-2 optimizers. Its hook handles read no training state: it answers while states are offloaded."""
        offload = getattr(self._owner()._live_stage(), "parameter_offload", None)
        if offload is None:
            raise AttributeError("parameter_offload")
        return offload

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16), as DeepSpeed's ZeRO and fp16 optimizers give it; also
        under their other name, `cur_scale` (Megatron-DeepSpeed and training scripts log it)."""
        return self._owner().precision.loss_scale

    cur_scale = loss_scale

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the wrapped optimizer's attributes and hooks.
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------------------ the loop's calls
    def _owner(self) -> Engine:
        engine = self._engine()
        if engine is None:
            raise RuntimeError(
                "the engine this optimizer belongs to no longer exists; create a new one with engine.initialize()"
            )
        return engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Release the parameters' .grad references; never the engine's accumulated gradients (see the
        module docstring). set_to_none=False is treated the same: zeroing the engine's gradient views
        in place would discard an accumulation window."""
        for p in self._owner().module.parameters():
            p.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The whole ZeRO step now (engine.step() at a boundary); `closure` (forward and
        engine.backward) runs first, as torch's step(closure) does."""
        loss = closure() if closure is not None else None
        self._owner().step_from_optimizer()
        return loss
