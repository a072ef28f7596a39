"""DeepSpeed's tensor-fragment functions (`deepspeed.utils.safe_get_full_fp32_param` and the rest): read
and write a trained parameter's fp32 value, gradient and optimizer state, whichever ranks hold them.

    loss = engine(batch); engine.backward(loss)
    g = safe_get_full_grad(model.fc.weight)                  # the whole averaged gradient, on every rank
    safe_set_full_grad(model.fc.weight, g.clamp(-1, 1))      # what the step will use
    engine.step()
    m = safe_get_full_optimizer_state(model.fc.weight, "exp_avg")

At stages 1-3 each rank holds a slice of every master, gradient and optimizer state: the full_*
getters are collectives (every rank calls them, for the same parameters in the same order); the
setters are not (every rank is given the same whole value and keeps its slice). The local_* functions
read and write this rank's slice of a stage-3 parameter only. How values are found and assembled:
engine/zero/fragments.py.

Where this differs from DeepSpeed, on purpose: gradients are the mean gradient without fp16's loss
scale (DeepSpeed's still carry it); a new fp32 value also reaches the parameter the forward reads at
once (DeepSpeed's reaches it at the next step); getters return copies. A parameter no engine trains
(frozen, or never given to one) gets None from the getters, and `.grad` where it has one, as in
DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.zero import owners
from engine.zero.fragments import GRAD, PARAM, HeldState


def _held_at_stage3(param: torch.Tensor, function: str) -> HeldState | None:
    """The HeldState of a stage-3 parameter; None for a frozen one; an error for any other parameter."""
    held = owners.held_of(param)
    if held is not None and held.stage == 3:
        return held
    if held is None and owners.unit_of(param) is not None:
        return None  # a frozen stage-3 parameter: nothing trained, as DeepSpeed answers
    where = f"it is trained at zero_optimization.stage {held.stage}" if held is not None else "no engine trains it"
    raise ValueError(
        f"{function}: only ZeRO stage 3 partitioned parameters have a local partition, and {where}. "
        f"Use the full-value function instead ({function.replace('local', 'full')}), which works at every stage"
    )


# ------------------------------------------------------------------------------- full values
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of `param` (a collective at stages 1-3); None if no engine trains it."""
    held = owners.held_of(param)
    return held.full([param], PARAM)[0] if held is not None else None


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Give `param` a new whole fp32 value: its master and the parameter the forward reads. Every rank passes
    the same value."""
    held = owners.held_of(param)
    if held is not None:
        held.set_full(param, value, PARAM)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state `optim_state_key` of `param` (e.g. Adam's "exp_avg", "exp_avg_sq")."""
    held = owners.held_of(param)
    return held.full([param], optim_state_key)[0] if held is not None else None


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    held = owners.held_of(param)
    if held is not None:
        held.set_full(param, value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole reduced gradient of `param` (fp32, averaged, unscaled), after engine.backward() and before
    engine.step(); `param.grad` for a parameter no engine trains."""
    held = owners.held_of(param)
    if held is None:
        return param.grad
    return held.full([param], GRAD)[0]


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the gradient the next step uses (same units as safe_get_full_grad)."""
    held = owners.held_of(param)
    if held is not None:
        held.set_full(param, value, GRAD)
    elif param.grad is not None:
        param.grad.copy_(value)


def safe_update_full_grad_vectorized(
    param_list: Sequence[torch.Tensor], update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """For each parameter, its gradient becomes update_func(full_gradient, param). The full gradients of all
    trained parameters of one engine are read with a single collective."""
    by_state: dict[int, tuple[HeldState, list[torch.Tensor]]] = {}
    for p in param_list:
        held = owners.held_of(p)
        if held is not None:
            by_state.setdefault(id(held), (held, []))[1].append(p)
        elif p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
    for held, params in by_state.values():
        for p, grad in zip(params, held.full(params, GRAD)):
            held.set_full(p, update_func(grad, p), GRAD)


# ------------------------------------------------------------------------------ local values
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of a stage-3 parameter's fp32 master (1-D; empty where it holds none of it)."""
    held = _held_at_stage3(param, "safe_get_local_fp32_param")
    return held.local(param, PARAM) if held is not None else None


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    held = _held_at_stage3(param, "safe_set_local_fp32_param")
    if held is not None:
        held.set_local(param, value, PARAM)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    held = _held_at_stage3(param, "safe_get_local_grad")
    return held.local(param, GRAD) if held is not None else None


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    held = _held_at_stage3(param, "safe_set_local_grad")
    if held is not None:
        held.set_local(param, value, GRAD)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    held = _held_at_stage3(param, "safe_get_local_optimizer_state")
    return held.local(param, optim_state_key) if held is not None else None


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    held = _held_at_stage3(param, "safe_set_local_optimizer_state")
    if held is not None:
        held.set_local(param, value, optim_state_key)


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
