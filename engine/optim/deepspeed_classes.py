"""DeepSpeed's optimizer classes under their own names and constructor signatures
(`deepspeed.ops.adam.DeepSpeedCPUAdam` / `FusedAdam`, `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`,
`deepspeed.ops.lion.DeepSpeedCPULion`), for code that builds them itself: Accelerate replaces a
torch optimizer with one of the CPU classes when the optimizer is offloaded
(`map_pytorch_optim_to_deepspeed`), and scripts written for DeepSpeed import them by name.

Each class is the engine's own optimizer with DeepSpeed's argument order and names:
- DeepSpeedCPUAdam: the fused C++ Adam (engine.ops.adam.CPUAdam).
- FusedAdam: torch.optim.Adam (fused on CUDA, foreach on CPU), decoupled decay with adam_w_mode.
- DeepSpeedCPUAdagrad: torch.optim.Adagrad.
- DeepSpeedCPULion: engine.optim.Lion.

`fp32_optimizer_states=False` asks DeepSpeed to keep the state in the parameters' dtype. The engine's
optimizers always step fp32 master weights (mixed precision keeps them), so their state is fp32 either
way: the flag is accepted and changes nothing (more memory than DeepSpeed for bf16 params, same math).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engine.ops.adam import CPUAdam
from engine.optim.lion import Lion


class DeepSpeedCPUAdam(CPUAdam):
    """`deepspeed.ops.adam.DeepSpeedCPUAdam`: the engine's fused CPU Adam/AdamW (adamw_mode=True is
    AdamW, False is Adam with L2 decay)."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )


class FusedAdam(torch.optim.Adam):
    """`deepspeed.ops.adam.FusedAdam`: torch's Adam, fused kernels on CUDA; adam_w_mode=True (the
    default, as in DeepSpeed) decouples weight decay (AdamW)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant (nor does DeepSpeed's); "
                "use torch.optim.AdamW(amsgrad=True)"
            )
        if not bias_correction:
            raise ValueError(
                "FusedAdam(bias_correction=False) is built from the config here: use "
                '"optimizer": {"type": "Adam", "params": {"bias_correction": false}} in the '
                "DeepSpeed config instead of constructing FusedAdam"
            )
        params = list(params)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
            fused=_all_cuda(params) or None,
        )


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: torch's Adagrad with DeepSpeed's arguments."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant "
                "(DeepSpeed ignores the flag); leave amsgrad False"
            )
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    """`deepspeed.ops.lion.DeepSpeedCPULion`: the engine's Lion with DeepSpeed's arguments."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


def _all_cuda(params: list[Any]) -> bool:
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
