"""ZeRO-Offload (`zero_optimization.offload_optimizer.device: "cpu"`): the optimizer step as one fused
CPU pass over the fp32 master shards and their optimizer state.

ZeRO-Offload keeps the fp32 masters and the optimizer state in CPU memory and runs Adam there with a
vectorised, multi-threaded kernel (DeepSpeedCPUAdam). On this engine's CPU training the masters and
the state are in CPU memory already, so offload changes the step itself: instead of one pass to
multiply the gradient shards by the folded averaging / unscale / clip coefficient, one Adam pass and
one pass to cast the new masters into the low-precision parameter shards, `engine.ops.adam.adam_step`
reads each gradient once, applies the coefficient, updates m, v and the master, and writes the
low-precision copy in the same pass (engine/ops/adam.py; the torch fallback when the extension is not
built). Adam/AdamW (torch's, or the config's Adam with bias_correction false) take the fused path;
any other optimizer runs its own step on the same masters, followed by the cast.

Optimizer state stays in `optimizer.state[master]` under torch's AdamW keys ("step", "exp_avg",
"exp_avg_sq"), so state_dict() and checkpoints do not depend on whether offload was on.

Training on CUDA with offload (masters and state moved to host memory, gradients copied down and
parameters copied up) is refused at initialize() for now, by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.types import EngineConfig
from engine.ops.adam import adam_step
from engine.optim.adam import ReferenceAdam


def offload_enabled(config: EngineConfig) -> bool:
    return config.zero.offload_optimizer.device == "cpu"


@dataclass
class OffloadTarget:
    """One fp32 master (what the optimizer owns) and where its low-precision value lives, if anywhere."""

    master: torch.Tensor
    lp: torch.Tensor | None
    """The parameter shard in the model dtype (bf16/fp16), written in the same pass; None when the
    master is the parameter storage itself (fp32) or the stage casts while gathering (stage 3)."""


def _adam_mode(optimizer: torch.optim.Optimizer, group: dict) -> tuple[bool, bool] | None:
    """(adamw_mode, bias_correction) when the fused kernel computes exactly this optimizer, else None."""
    if isinstance(optimizer, ReferenceAdam):
        return bool(group["adam_w_mode"]), bool(group["bias_correction"])
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
            return None
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return bool(decoupled), True
    return None


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """A shard's rows, each contiguous (stage 1/2 shards are (buckets, slice) views, strided when they
    view the parameter buffer); every tensor of one parameter is split the same way."""
    if t.dim() == 2 and t.stride(1) == 1:
        return list(t.unbind(0))
    raise ValueError(f"offload: a shard of shape {tuple(t.shape)} and strides {t.stride()} has no contiguous rows")


class OptimizerOffload:
    def __init__(self, optimizer: torch.optim.Optimizer, targets: list[OffloadTarget]) -> None:
        self.optimizer = optimizer
        self.targets = {id(t.master): t for t in targets}
        self.fused_steps = 0
        """Steps taken by the fused kernel (the rest ran the optimizer's own step)."""

    def step(self, coef: float) -> None:
        """The optimizer step on gradients that still need multiplying by `coef`; afterwards every
        low-precision target holds its new master's value."""
        modes = [_adam_mode(self.optimizer, g) for g in self.optimizer.param_groups]
        fused_modes = [m for m in modes if m is not None]
        if len(fused_modes) < len(modes):  # a group the fused kernel does not compute exactly
            self._plain_step(coef)
            return
        for group, (adamw_mode, bias_correction) in zip(self.optimizer.param_groups, fused_modes):
            self._fused_group(group, coef, adamw_mode, bias_correction)
        self.fused_steps += 1

    def _fused_group(self, group: dict, coef: float, adamw_mode: bool, bias_correction: bool) -> None:
        params, grads, avgs, sqs, lps = [], [], [], [], []
        step = None
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["step"] += 1
            step = int(state["step"].item()) if step is None else step
            lp = self.targets[id(p)].lp if id(p) in self.targets else None
            pieces = [p, p.grad, state["exp_avg"], state["exp_avg_sq"]] + ([lp] if lp is not None else [])
            if all(t.is_contiguous() for t in pieces):
                rows = [[t.reshape(-1)] for t in pieces]
            else:
                rows = [_rows(t) for t in pieces]
            params += rows[0]
            grads += rows[1]
            avgs += rows[2]
            sqs += rows[3]
            if lp is not None:
                lps += rows[4]
        if step is None:
            return
        if lps and len(lps) != len(params):
            raise ValueError("offload: every parameter of an optimizer group must have a low-precision copy or none")
        beta1, beta2 = group["betas"]
        adam_step(params, grads, avgs, sqs, lps or None, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                  eps=group["eps"], weight_decay=group["weight_decay"], adamw_mode=adamw_mode, step=step,
                  bias_correction=bias_correction, grad_scale=coef)

    def _plain_step(self, coef: float) -> None:
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and coef != 1.0:
                        p.grad.mul_(coef)
            self.optimizer.step()
            for target in self.targets.values():
                if target.lp is not None:
                    target.lp.copy_(target.master)
