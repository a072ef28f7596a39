"""Fused CPU Adam/AdamW: one pass over memory per step, with unscale/clip and the low-precision copy.

    adam_step(AdamTensors(params, grads, exp_avgs, exp_avg_sqs, lp_params), AdamScalars(lr=..., step=..., ...))
    opt = CPUAdam(model.parameters(), lr=1e-3)   # DeepSpeedCPUAdam-like torch.optim.Optimizer

torch.optim.AdamW(fused=True) on CPU already runs near the DRAM limit, but pays a few microseconds per
tensor, and unscaling (loss scale), the clip coefficient and the cast to the bf16 model copy are
separate passes over memory. `adam_step` does all of it in one pass of the compiled op in
csrc/cpu/adam.cpp (one call for all tensors; 28 bytes per parameter with bf16 gradients and a bf16
copy, each gradient upcast in registers; csrc/cuda for CUDA tensors), and falls back to
`adam_step_reference`, the same math as torch ops on bounded pieces, when the extension is not built
(see engine/ops/builder.py) or the tensors are on mixed devices.

[Note: Adam math we match]
Per element, after g = float(grad) * grad_scale, exactly torch.optim.Adam's single-tensor path:
    adamw_mode (AdamW):  p <- p * (1 - lr * weight_decay)        (decoupled decay)
    otherwise (Adam):    g <- g + weight_decay * p                (L2, goes through the moments)
    m <- lerp(m, g, 1 - beta1);   v <- v * beta2 + (1 - beta2) * g^2
    p <- p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - beta_i^step (1 without bias_correction)
The scalar coefficients are computed in double, the elements in float32. The compiled op and the
fallback differ only by float rounding (the fallback is bitwise torch's AdamW when grad_scale is 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from engine.ops.checks import AdamTensors, check_lists, check_tensors
from engine.ops.select import compiled_module

_PIECE = 1 << 18
"""Elements the torch path updates at a time (1 MiB of float32 per temporary)."""


@dataclass(frozen=True)
class AdamScalars:
    """The scalars of one Adam/AdamW step (see [Note: Adam math we match])."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    """The step count including this update (1 on the first step)."""
    adamw_mode: bool = True
    """Decoupled weight decay (AdamW); False: L2 through the moments (Adam)."""
    bias_correction: bool = True
    grad_scale: float = 1.0
    """Every gradient is multiplied by it first (e.g. clip_coef / loss_scale)."""

    @classmethod
    def of_group(
        cls, group: dict[str, Any], step: int, *, adamw_mode: bool, bias_correction: bool, grad_scale: float
    ) -> AdamScalars:
        """A torch param group's scalars now (its learning rate as the scheduler left it), at `step`."""
        beta1, beta2 = group["betas"]
        return cls(
            float(group["lr"]),
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            step,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            grad_scale=grad_scale,
        )

    def check(self) -> None:
        """Named ValueErrors for values the step cannot use."""
        step = self.step
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"adam_step: step must be an int >= 1 (the count including this update), got {step!r}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"adam_step: betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        for name, value in (("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay)):
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"adam_step: {name} must be finite and >= 0, got {value!r}")
        if not math.isfinite(self.grad_scale):
            raise ValueError(
                f"adam_step: grad_scale must be finite, got {self.grad_scale!r}; skip the step when the "
                "gradients overflowed instead of stepping with a non-finite scale"
            )

    def kernel_args(self) -> tuple[float, float, float, float, float, bool, int, bool, float]:
        """The scalar arguments of the compiled adam_step, in its order (csrc/cpu/adam.cpp, csrc/cuda)."""
        return (
            float(self.lr),
            float(self.beta1),
            float(self.beta2),
            float(self.eps),
            float(self.weight_decay),
            bool(self.adamw_mode),
            int(self.step),
            bool(self.bias_correction),
            float(self.grad_scale),
        )


def adam_step(tensors: AdamTensors, hyper: AdamScalars) -> None:
    """One Adam/AdamW update of every tensor in place (see [Note: Adam math we match]).

    tensors: params, exp_avgs, exp_avg_sqs float32 and contiguous; grads float32, bfloat16 or float16,
    multiplied by hyper.grad_scale before use; lp_params None/empty, or one bfloat16 or float16 tensor
    per param that receives the updated parameter (round to nearest even, as `.to()`).
    """
    params, grads, exp_avgs, exp_avg_sqs, lp = tensors
    lp_params = list(lp) if lp else []
    tensors = AdamTensors(params, grads, exp_avgs, exp_avg_sqs, lp_params)
    check_lists(tensors)
    hyper.check()
    ext = compiled_module(params)
    if ext is not None and all(g.device == params[0].device for g in grads):
        # The CPU binding checks every tensor itself (dtype, device, contiguity, size) in one scan that
        # also collects the pointers, naming a bad one with check_tensors' message. The CUDA module's
        # checks are TORCH_CHECKs, and a C++ exception thrown from an extension has killed the process
        # on a lent H200's image (benchmarks/results/gpu_h200.md): CUDA tensors are checked here first.
        if params and params[0].is_cuda:
            check_tensors(tensors)
        ext.adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lp_params, *hyper.kernel_args())
        return
    check_tensors(tensors)
    adam_step_reference(tensors, hyper)


@torch.no_grad()
def adam_step_reference(tensors: AdamTensors, hyper: AdamScalars) -> None:
    """adam_step as torch ops, in torch.optim.Adam's order; no argument checks (the naive path).

    Each tensor is processed in pieces of _PIECE elements, so the float32 temporaries (the upcast and
    scaled gradient, the denominator) are bounded instead of the size of the tensor: a low-precision
    gradient is never converted to float32 as a whole. Elementwise math, so the pieces change nothing."""
    params, grads, exp_avgs, exp_avg_sqs, lp_params = tensors
    lr, beta1, beta2, eps, weight_decay = hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
    step, grad_scale = hyper.step, hyper.grad_scale
    bias_correction1 = 1 - beta1**step if hyper.bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if hyper.bias_correction else 1.0
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        pieces_of = [param, grad, exp_avg, exp_avg_sq] + ([lp_params[i]] if lp_params else [])
        for pieces in zip(*(t.view(-1).split(_PIECE) for t in pieces_of)):
            p, grad_piece, m, v = pieces[:4]
            g = grad_piece.float()  # the gradient itself when already fp32: never modified in place below
            if grad_scale != 1.0:
                g = g * grad_scale
            if weight_decay != 0:
                if hyper.adamw_mode:
                    p.mul_(1 - lr * weight_decay)
                else:
                    g = g.add(p, alpha=weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
            if lp_params:
                pieces[4].copy_(p)


@dataclass
class AdamEntry:
    """One parameter's tensors for adam_step_entries: each a list of contiguous pieces, split alike (a
    whole tensor is one piece; a strided shard view is one piece per row)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    lp_params: list[torch.Tensor] | None
    """Where the updated parameter is also written in bf16/fp16, or None."""
    step: torch.Tensor
    """The parameter's float32 step count (torch.optim.AdamW's state["step"]), advanced here."""


def adam_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """`state` (an optimizer's state for p), initialised in torch.optim.AdamW's layout when empty, so
    state_dicts are interchangeable with torch's; the moments are contiguous whatever p's strides."""
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return state


def adam_step_entries(
    entries: Sequence[AdamEntry], group: dict[str, Any], *, adamw_mode: bool, bias_correction: bool, grad_scale: float
) -> None:
    """One Adam/AdamW step of every entry with one param group's hyper-parameters: the step counts
    advanced by one foreach call, then one adam_step per (step count, copy-out or not), normally the
    whole group at once (counts differ only after loading state where some parameters were skipped)."""
    if not entries:
        return
    steps = [e.step for e in entries]
    torch._foreach_add_(steps, 1.0)
    batches: dict[tuple[int, bool], list[AdamEntry]] = {}
    for entry, count in zip(entries, torch.stack(steps).tolist()):
        batches.setdefault((int(count), entry.lp_params is not None), []).append(entry)
    for (count, has_lp), members in batches.items():
        hyper = AdamScalars.of_group(
            group, count, adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale
        )
        tensors = AdamTensors(
            [t for e in members for t in e.params],
            [t for e in members for t in e.grads],
            [t for e in members for t in e.exp_avgs],
            [t for e in members for t in e.exp_avg_sqs],
            [t for e in members for t in e.lp_params or ()] if has_lp else None,
        )
        adam_step(tensors, hyper)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on fp32 parameters through the fused `adam_step` (DeepSpeedCPUAdam's arguments).

    State per parameter is torch.optim.AdamW's ("step" a float32 scalar tensor, "exp_avg",
    "exp_avg_sq"), so state_dicts load into either optimizer. adamw_mode=True matches
    torch.optim.AdamW, False torch.optim.Adam (L2 weight decay); bias_correction=False drops the
    bias correction as DeepSpeed's optimizers allow. Hyper-parameters are read from each param
    group at every step, so LR schedulers work as with torch's optimizers.

    step(grad_scale=s) multiplies every gradient by s first (clip_coef / loss_scale); step(lp_params=[...])
    writes each updated parameter into the matching low-precision tensor in the same pass (one entry
    per parameter, flattened over param_groups in order; None entries get no copy).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise NotImplementedError(
                "CPUAdam does not implement amsgrad (nor does DeepSpeedCPUAdam); use "
                "torch.optim.AdamW(amsgrad=True) for it"
            )
        beta1, beta2 = betas
        AdamScalars(lr, beta1, beta2, eps, weight_decay, step=1).check()
        defaults = {
            "lr": lr,
            "betas": (beta1, beta2),
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw_mode": adamw_mode,
            "bias_correction": bias_correction,
            "amsgrad": False,
        }
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A torch.optim.Adam/AdamW state_dict has no adamw_mode/bias_correction: this optimizer's
        # constructor arguments apply (as torch's AdamW forces decoupled decay on whatever it loads).
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            group.setdefault("amsgrad", False)
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if "step" in p_state and not torch.is_tensor(p_state["step"]):  # pre-1.12 torch saved an int
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    # torch.optim.Optimizer's overloads (the closure's loss when given one, else None), plus our keywords.
    @overload
    def step(
        self, closure: None = None, *, grad_scale: float = 1.0, lp_params: Sequence[torch.Tensor | None] | None = None
    ) -> None: ...
    @overload
    def step(
        self,
        closure: Callable[[], float],
        *,
        grad_scale: float = 1.0,
        lp_params: Sequence[torch.Tensor | None] | None = None,
    ) -> float: ...

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: float = 1.0,
        lp_params: Sequence[torch.Tensor | None] | None = None,
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lp_of = self._check_lp_params(lp_params)
        index = 0
        for group in self.param_groups:
            # The params of this group that have a gradient, with their state and copy target.
            entries: list[AdamEntry] = []
            for p in group["params"]:
                lp = lp_of[index] if lp_of is not None else None
                index += 1
                if p.grad is not None:
                    state = adam_state(self.state[p], p)
                    entries.append(
                        AdamEntry(
                            [p],
                            [self._grad_of(p)],
                            [state["exp_avg"]],
                            [state["exp_avg_sq"]],
                            None if lp is None else [lp],
                            state["step"],
                        )
                    )
            if entries:
                self._check_group(group)
                adam_step_entries(
                    entries,
                    group,
                    adamw_mode=group["adamw_mode"],
                    bias_correction=group["bias_correction"],
                    grad_scale=grad_scale,
                )
        return loss

    @staticmethod
    def _grad_of(p: torch.Tensor) -> torch.Tensor:
        grad = p.grad
        assert grad is not None  # the caller skips params without a gradient
        if grad.is_sparse:
            raise RuntimeError("CPUAdam does not support sparse gradients; use torch.optim.SparseAdam")
        return grad if grad.is_contiguous() else grad.contiguous()

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise NotImplementedError(
                    f"CPUAdam does not implement {key}=True (found in a param group, e.g. "
                    "from a loaded torch.optim.AdamW state_dict); use torch.optim.AdamW"
                )

    def _check_lp_params(self, lp_params: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
        if lp_params is None:
            return None
        total = sum(len(group["params"]) for group in self.param_groups)
        if len(lp_params) != total:
            raise ValueError(
                f"CPUAdam.step: lp_params has {len(lp_params)} entries but the optimizer has {total} "
                "params; pass one tensor (or None) per param, flattened over param_groups in order"
            )
        return list(lp_params)
