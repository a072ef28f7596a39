"""F.linear for stage-3 weights that saves the weight Parameter for backward, not a view of it.

Autograd's linear saves `weight.t()` (a view) to compute the input's gradient. For a stage-3 weight
that view points into the unit's gathered flat buffer, so releasing the unit after its forward
(`param.data = empty`) frees nothing: every block's gathered buffer stays alive until its backward,
as if all were kept (measured on GPT-S, 4 blocks: 12 MiB more in use than the engine counted, every
block). Saving the Parameter itself keeps only the parameter object; its data is swapped back in when
the unit is gathered again before its backward. DeepSpeed does the same
(`zero_optimization.memory_efficient_linear`, default true, read here with the same default).

While any stage-3 engine that wants it is alive, `torch.nn.functional.linear` is this module's
`linear`, which takes that path only for weights a stage-3 engine owns and calls the original
otherwise. The forward is the original op (bitwise); the backward is the same two matrix products
and sum autograd's linear does.

The weight's gradient is computed straight into its slot of the unit's gradient bucket where the stage
has one to give (`UnitHandle.grad_slot`, see UnitGradients.slot): autograd then hands that very tensor
to the parameter, and the stage's hook finds it already in place. Otherwise every weight gradient is
fresh memory (page faults: on a 3.65B ZeRO-Infinity backward, a third of its CPU went to first
touches) and is then copied into the bucket.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from engine.zero import owners

_original_linear = F.linear
_lock = threading.Lock()
_users = 0


class _LinearSavingWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[1]:
            flat_input = input.reshape(-1, input.shape[-1])
            handle = owners.unit_of(weight)
            # (Not when the backward records a graph, create_graph=True: a product written into `out=` has none.)
            slot = None
            if handle is not None and not torch.is_grad_enabled() and flat_input.dtype == flat_grad.dtype:
                slot = handle.grad_slot(weight, flat_grad.dtype)
            if slot is not None:  # into the bucket: see the module's note
                grad_weight = torch.mm(flat_grad.t(), flat_input, out=slot)
            else:
                grad_weight = flat_grad.t().matmul(flat_input)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_input, grad_weight, grad_bias


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Inside a compiled region torch's linear is traced as it is: the lookup below would break the graph at
    # every linear, and the compiled backward saves what its partitioner chooses (docs/compile.md).
    if torch.compiler.is_compiling():
        return _original_linear(input, weight, bias)
    if torch.is_grad_enabled() and owners.unit_of(weight) is not None:
        return _LinearSavingWeight.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


def install() -> None:
    """One more user: F.linear is `linear` while there is any."""
    global _users
    with _lock:
        _users += 1
        F.linear = linear


def uninstall() -> None:
    """One user fewer: the original F.linear is back once there is none."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            F.linear = _original_linear
