"""engine/zero/stage3/memory_efficient_linear.py: F.linear for stage-3 weights, against torch's own linear (forward bitwise,
gradients to float tolerance), and that it is installed only while someone needs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.zero.stage3 import memory_efficient_linear as linear
from engine.zero import owners
from engine.zero.released import ZeroParamStatus


def _own(w: torch.Tensor) -> None:
    """What a stage-3 engine does for the weights it owns (a unit that is never gathered here)."""
    owners.set_unit(
        w,
        owners.UnitHandle(
            gather=lambda: False,
            release=lambda: None,
            scatter_from=lambda src: None,
            status=lambda: ZeroParamStatus.AVAILABLE,
        ),
    )


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (0, 7)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_matches_torch_linear(shape: tuple[int, ...], bias: bool, frozen_weight: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 7, generator=g, dtype=torch.float64), requires_grad=not frozen_weight)
    b = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64)) if bias else None
    _own(w)
    out = linear.linear(x, w, b)
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w) + ((b,) if bias else ())]
    ref = torch.nn.functional.linear(*ref_inputs)
    assert out.grad_fn is not None and "LinearSavingWeight" in type(out.grad_fn).__name__
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip((x, w) + ((b,) if bias else ()), ref_inputs):
        if theirs.requires_grad:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)
        else:
            assert mine.grad is None


def test_saves_the_weight_not_a_view() -> None:
    """The gathered buffer behind a released weight is freed: nothing in the graph refers to it."""
    full = torch.randn(4 * 7)
    w = torch.nn.Parameter(full.view(4, 7))
    _own(w)
    x = torch.randn(3, 7, requires_grad=True)
    out = linear.linear(x, w)
    w.data = torch.empty(0)  # a stage-3 release
    del full
    saved = [t for t in out.grad_fn.saved_tensors if t is not x]
    assert all(t.untyped_storage().nbytes() == 0 for t in saved)


def test_install_counts_users() -> None:
    original = F.linear
    linear.install()
    linear.install()
    assert F.linear is linear.linear
    linear.uninstall()
    assert F.linear is linear.linear
    linear.uninstall()
    assert F.linear is original
    other = torch.nn.Linear(3, 2)  # weights no engine owns: the original op
    assert other(torch.randn(1, 3)).grad_fn.name() != "_LinearSavingWeightBackward"
