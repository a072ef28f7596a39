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
  Then each low-precision parameter is cast from its master.

Before either path the gradients were read once more, for the global norm and the overflow vote
(engine/precision.py): clipping needs the norm over every rank before any update, so that read
cannot join the update's pass.

Optimizer state stays in `optimizer.state[master]` under torch's AdamW keys ("step", "exp_avg",
"exp_avg_sq") on both paths, so state_dict() and checkpoints do not depend on the path taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.config.types import EngineConfig
from engine.ops.adam import CPUAdam, adam_step
from engine.optim.adam import ReferenceAdam


def offload_enabled(config: EngineConfig) -> bool:
    return config.zero.offload_optimizer.device == "cpu"


@dataclass
class MasterTarget:
    """One tensor the optimizer steps, its gradient, and where its low-precision value lives."""

    master: torch.Tensor
    """fp32: a shard (possibly a (buckets, slice) view of the parameter buffer) or a parameter's view."""
    grad: torch.Tensor
    """Same shape, in the accumulation dtype (float32, bfloat16 or float16)."""
    lp: torch.Tensor | None
    """The parameter storage in the model dtype, written after the step; None when the master is
    that storage (fp32) or the stage casts while gathering (stage 3)."""


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


def _pieces(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors of one target (same shape) as contiguous 1-D pieces, split alike: each whole, or
    row by row when one is a strided (buckets, slice) view of the parameter buffer."""
    if all(t.is_contiguous() for t in tensors):
        return [[t.reshape(-1)] for t in tensors]
    if all(t.dim() == 2 and t.stride(1) == 1 for t in tensors):
        return [list(t.unbind(0)) for t in tensors]
    raise ValueError(f"master step: tensors of shape {tuple(tensors[0].shape)} and strides "
                     f"{[t.stride() for t in tensors]} have no contiguous rows")


class MasterStep:
    def __init__(self, optimizer: torch.optim.Optimizer, targets: list[MasterTarget], *, offload: bool) -> None:
        self.optimizer = optimizer
        self.targets = {id(t.master): t for t in targets}
        self.offload = offload
        self._low_precision = any(t.grad.dtype != torch.float32 for t in targets)
        for t in targets:
            # An fp32 gradient is the master's .grad for good (the plain path and user code see it);
            # a low-precision one cannot be (torch wants the parameter's dtype).
            t.master.grad = t.grad if t.grad.dtype == torch.float32 else None
        self.fused_steps = 0
        """Steps taken by the fused kernel (the rest ran the optimizer's own step)."""

    def step(self, coef: float) -> None:
        """Update every master from `coef` x its gradient; afterwards every low-precision parameter
        holds its new master's value."""
        modes = [_adam_mode(self.optimizer, g) for g in self.optimizer.param_groups]
        if (self.offload or self._low_precision) and all(m is not None for m in modes):
            for group, mode in zip(self.optimizer.param_groups, modes):
                assert mode is not None
                self._fused_group(group, coef, *mode)
            self.fused_steps += 1
        else:
            self._plain_step(coef)

    def _fused_group(self, group: dict[str, Any], coef: float, adamw_mode: bool, bias_correction: bool) -> None:
        work = [(self.targets[id(p)], self._state_of(p)) for p in group["params"]]
        if not work:
            return
        steps = [state["step"] for _, state in work]
        torch._foreach_add_(steps, 1.0)
        # One call per (step count, low-precision copy or not): normally the whole group. Counts differ
        # only after loading state saved by an optimizer that skipped some parameters; a group mixing
        # fp32 and bf16 parameters has targets with and without a copy.
        batches: dict[tuple[int, bool], list[int]] = {}
        for i, count in enumerate(torch.stack(steps).tolist()):
            batches.setdefault((int(count), work[i][0].lp is not None), []).append(i)
        beta1, beta2 = group["betas"]
        for (count, _), members in batches.items():
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            avgs: list[torch.Tensor] = []
            sqs: list[torch.Tensor] = []
            lps: list[torch.Tensor] = []
            for i in members:
                target, state = work[i]
                tensors = [target.master, target.grad, state["exp_avg"], state["exp_avg_sq"]]
                pieces = _pieces(tensors + ([target.lp] if target.lp is not None else []))
                params += pieces[0]
                grads += pieces[1]
                avgs += pieces[2]
                sqs += pieces[3]
                if target.lp is not None:
                    lps += pieces[4]
            adam_step(params, grads, avgs, sqs, lps or None, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                      eps=group["eps"], weight_decay=group["weight_decay"], adamw_mode=adamw_mode, step=count,
                      bias_correction=bias_correction, grad_scale=coef)

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.optimizer.state[p]
        if not state:  # torch.optim.AdamW's layout, so state_dicts are interchangeable
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def _plain_step(self, coef: float) -> None:
        transient = []
        for t in self.targets.values():
            if t.grad.dtype == torch.float32:
                if coef != 1.0:
                    t.grad.mul_(coef)
            else:
                t.master.grad = t.grad.to(torch.float32).mul_(coef)
                transient.append(t)
        try:
            self.optimizer.step()
        finally:
            for t in transient:
                t.master.grad = None
        for t in self.targets.values():
            if t.lp is not None:
                t.lp.copy_(t.master)
