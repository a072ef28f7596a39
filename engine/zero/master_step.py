"""The optimizer step on the fp32 masters, whatever dtype their gradients are in.

Every stage hands the optimizer fp32 masters (a shard, or at stage 0 one view per parameter) and keeps
each master's gradient in the accumulation dtype (`data_types.grad_accum_dtype`; by default the
model's dtype, as in DeepSpeed: bf16 training keeps bf16 gradients, 2 bytes per element instead of
4, the paper's Table 1). torch's optimizers cannot read such a gradient (`.grad` must have the
parameter's dtype), so `MasterStep.step(coef)` chooses between two paths:

* fused (Adam/AdamW: torch's, DeepSpeed's config Adam, CPUAdam): `engine.ops.adam.adam_step` reads
  each gradient once in its own dtype, multiplies it by `coef` (averaging, unscaling and clipping
  folded into one factor) and upcasts it in registers, updates m, v and the master, and writes the
  low-precision parameter in the same pass. No fp32 gradient exists at any point (the pure-torch
  fallback converts a bounded piece at a time). Taken whenever a gradient is not fp32, and for every
  gradient with ZeRO-Offload (`offload_optimizer.device: "cpu"`), whose point is this one pass.
* plain (every other optimizer, or fp32 gradients without offload): the optimizer's own step. fp32
  gradients are the masters' `.grad` all along and are multiplied in place; a low-precision gradient
  is converted to an fp32 `.grad` for the step and dropped after it (DeepSpeed does the same per
  group), a transient 4 bytes per shard element that SGD, Adagrad, LAMB and user optimizers pay.
  Then the stage casts the masters into the low-precision parameters (`refresh`, one parallel copy
  per flat group).

Before either path the gradients were read once more, for the global norm and the overflow vote
(engine/zero/shard_step.py): clipping needs the norm over every rank before any update, so that read
cannot join the update's pass.

Optimizer state stays in `optimizer.state[master]` under torch's AdamW keys ("step", "exp_avg",
"exp_avg_sq") on both paths, so state_dict() and checkpoints do not depend on the path taken.

# [Note: the optimizer object the user still holds]
# The torch optimizer given to initialize() steps the masters, so the user's own reference to it
# must not break the engine. Its zero_grad() (set_to_none, the default) drops the masters' `.grad`:
# the plain path therefore binds each fp32 gradient as `.grad` right before every step instead of
# once (a binding made once was silently undone by zero_grad, and the step updated nothing). Its
# step() would update the masters from unreduced, unclipped gradients and bypass the stage: a
# step pre-hook refuses any step() that this class did not start, naming what to call instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config.errors import ConfigError
from engine.config.types import EngineConfig
from engine.offload import SwapDir
from engine.offload.nvme_setup import NvmeSettings
from engine.offload.optimizer_swap import OptimizerSwap
from engine.ops.adam import AdamEntry, CPUAdam, adam_state, adam_step_entries
from engine.ops.flatten import contiguous_pieces
from engine.optim.adam import ReferenceAdam

_STEPPING = "_zero_engine_stepping"
"""Set in the optimizer's __dict__ while MasterStep runs its step(): the guard lets that one through."""
_GUARDED = "_zero_engine_step_guard"
"""The guard's hook handle, in the optimizer's __dict__ (registered once per optimizer object)."""


class DirectOptimizerStepError(RuntimeError):
    """step() on the torch optimizer given to engine.initialize(), outside the engine's step."""


def _refuse_direct_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not vars(optimizer).get(_STEPPING):
        raise DirectOptimizerStepError(
            f"step() was called on the {type(optimizer).__name__} given to engine.initialize(); the engine "
            "owns it now (its parameters are the engine's fp32 masters, and a step needs the gradients reduced "
            "across ranks, unscaled and clipped first), so nothing was updated. Call engine.step(), or step() "
            "on the optimizer engine.initialize() returned, which takes the whole ZeRO step"
        )


def guard_direct_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse step() on `optimizer` unless MasterStep runs it. See [Note: the optimizer object the user
    still holds]."""
    if _GUARDED not in vars(optimizer):
        vars(optimizer)[_GUARDED] = optimizer.register_step_pre_hook(_refuse_direct_step)


def offload_enabled(config: EngineConfig) -> bool:
    """The step runs as one fused CPU pass over the masters: ZeRO-Offload to host memory or to NVMe."""
    return config.zero.offload_optimizer.device in ("cpu", "nvme")


@dataclass
class MasterTarget:
    """One tensor the optimizer steps, its gradient, and where its low-precision value lives."""

    master: torch.Tensor
    """fp32: a shard (possibly a (buckets, slice) view of the parameter buffer) or a parameter's view."""
    grad: torch.Tensor
    """Same shape, in the accumulation dtype (float32, bfloat16 or float16)."""
    lp: torch.Tensor | None
    """The parameter storage in the model dtype, which the fused path writes in its pass; None when
    the master is that storage (fp32) or the stage casts while gathering (stage 3)."""


def _adam_mode(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[bool, bool] | None:
    """(adamw_mode, bias_correction) when the fused kernel computes exactly this optimizer, else None."""
    if isinstance(optimizer, ReferenceAdam):
        return bool(group["adam_w_mode"]), bool(group["bias_correction"])
    if isinstance(optimizer, CPUAdam):
        if group.get("amsgrad") or group.get("maximize"):
            return None
        return bool(group["adamw_mode"]), bool(group["bias_correction"])
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
            return None
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return bool(decoupled), True
    return None


class MasterStep:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        targets: list[MasterTarget],
        *,
        offload: bool,
        refresh: Callable[[], None] | None = None,
        nvme: NvmeSettings | None = None,
        swap_dir: SwapDir | None = None,
    ) -> None:
        """`refresh`: after the plain path, write the updated masters into the low-precision parameters
        (the stage's own cast, one call per group); None when no target has a low-precision copy.
        `nvme`: the optimizer state lives in swap files (engine/offload/optimizer_swap.py), in `swap_dir`
        when the stage opened it already."""
        self.optimizer = optimizer
        self._refresh = refresh
        self.targets = {id(t.master): t for t in targets}
        self.offload = offload
        self._low_precision = any(t.grad.dtype != torch.float32 for t in targets)
        for t in targets:
            # An fp32 gradient is the master's .grad (user code reading it sees the gradient); a
            # low-precision one cannot be (torch wants the parameter's dtype).
            t.master.grad = t.grad if t.grad.dtype == torch.float32 else None
        guard_direct_step(optimizer)
        self.swap: OptimizerSwap | None = None
        if nvme is not None:
            if any(_adam_mode(optimizer, g) is None for g in optimizer.param_groups):
                raise ConfigError(
                    f'zero_optimization.offload_optimizer.device "nvme": the swapped step is the fused Adam '
                    f"(Adam/AdamW, DeepSpeed's Adam/AdamW/CPUAdam, no amsgrad); {type(optimizer).__name__} "
                    'cannot take it: use an Adam optimizer or device "cpu"/"none"'
                )
            self.swap = OptimizerSwap(optimizer, targets, nvme, swap_dir)
        self.fused_steps = 0
        """Steps taken by the fused kernel (the rest ran the optimizer's own step)."""

    def step(self, coef: float) -> None:
        """Update every master from `coef` x its gradient; afterwards every low-precision parameter
        holds its new master's value."""
        modes = [_adam_mode(self.optimizer, g) for g in self.optimizer.param_groups]
        if self.swap is not None:
            groups = []
            for group, mode in zip(self.optimizer.param_groups, modes):
                assert mode is not None  # checked when the swap was built
                groups.append((group, *mode))
            self.swap.step(groups, coef)
            self.fused_steps += 1
            vars(self.optimizer)["_opt_called"] = True
        elif (self.offload or self._low_precision) and all(m is not None for m in modes):
            for group, mode in zip(self.optimizer.param_groups, modes):
                assert mode is not None
                self._fused_group(group, coef, *mode)
            self.fused_steps += 1
            # The optimizer was stepped, by the kernel instead of its step(): torch's LR schedulers watch
            # for step() and would warn "lr_scheduler.step() before optimizer.step()" at every bf16 run.
            vars(self.optimizer)["_opt_called"] = True
        else:
            self._plain_step(coef)

    def _fused_group(self, group: dict[str, Any], coef: float, adamw_mode: bool, bias_correction: bool) -> None:
        entries = []
        for p in group["params"]:
            target, state = self.targets[id(p)], adam_state(self.optimizer.state[p], p)
            lp = [target.lp] if target.lp is not None else []
            master, grad, avg, sq, *lp_pieces = contiguous_pieces(
                [target.master, target.grad, state["exp_avg"], state["exp_avg_sq"], *lp]
            )
            entries.append(AdamEntry(master, grad, avg, sq, lp_pieces[0] if lp_pieces else None, state["step"]))
        adam_step_entries(entries, group, adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=coef)

    @torch.no_grad()
    def _plain_step(self, coef: float) -> None:
        transient = []
        for t in self.targets.values():
            if t.grad.dtype == torch.float32:
                if coef != 1.0:
                    t.grad.mul_(coef)
                # Bound now, not once: the user's optimizer.zero_grad() may have dropped it. See
                # [Note: the optimizer object the user still holds].
                t.master.grad = t.grad
            else:
                t.master.grad = t.grad.to(torch.float32).mul_(coef)
                transient.append(t)
        vars(self.optimizer)[_STEPPING] = True
        try:
            self.optimizer.step()
        finally:
            vars(self.optimizer)[_STEPPING] = False
            for t in transient:
                t.master.grad = None
        if self._refresh is not None:
            self._refresh()
