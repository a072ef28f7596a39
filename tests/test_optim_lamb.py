"""Lamb against hand-computed FusedLamb steps; the trust-ratio clamp; Lion's sign update."""

from __future__ import annotations

import math

import pytest
import torch

from engine.optim import Lamb, Lion


def _one_param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def test_lamb_first_step_by_hand() -> None:
    # p = [3, 4] has norm 5. With bias correction, step 1 gives m_hat = g and v_hat = g^2, so with
    # eps = 0 the Adam direction is sign(g) = [1, -1]. Decay adds 0.1 * p = [0.3, 0.4]:
    # update = [1.3, -0.6], ||update|| = sqrt(1.69 + 0.36) = sqrt(2.05).
    # trust ratio = 5 / sqrt(2.05) = 3.4921... (inside [0.01, 10]); p <- p - lr * ratio * update.
    p = _one_param([3.0, 4.0])
    opt = Lamb([p], lr=0.1, eps=0.0, weight_decay=0.1)
    p.grad = torch.tensor([2.0, -0.5], dtype=torch.float64)
    opt.step()
    ratio = 5.0 / math.sqrt(2.05)
    expected = [3.0 - 0.1 * ratio * 1.3, 4.0 - 0.1 * ratio * -0.6]
    torch.testing.assert_close(p.detach(), torch.tensor(expected, dtype=torch.float64))
    assert opt.get_lamb_coeffs() == pytest.approx([ratio])


def _scalar_lamb(p, grads, lr, b1, b2, eps, wd, bias_correction, lo, hi):
    """Independent list-based LAMB (FusedLamb semantics) for a single tensor."""
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2**t if bias_correction else 1.0
        u = [(mi / bc1) / (math.sqrt(vi / bc2) + eps) + wd * pi for mi, vi, pi in zip(m, v, p)]
        w_norm = math.sqrt(sum(x * x for x in p))
        u_norm = math.sqrt(sum(x * x for x in u))
        ratio = min(max(w_norm / u_norm, lo), hi) if w_norm and u_norm else 1.0
        p = [pi - lr * ratio * ui for pi, ui in zip(p, u)]
    return p


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_several_steps_match_scalar_reference(bias_correction: bool) -> None:
    start = [0.5, -1.5, 2.0, 0.25]
    grads = [[0.1, -0.2, 0.3, 0.05], [-0.4, 0.1, 0.2, 0.0], [0.3, 0.3, -0.1, 0.2]]
    p = _one_param(start)
    opt = Lamb(
        [p],
        lr=0.05,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.01,
        bias_correction=bias_correction,
        max_coeff=10.0,
        min_coeff=0.01,
    )
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = _scalar_lamb(start, grads, 0.05, 0.8, 0.99, 1e-6, 0.01, bias_correction, 0.01, 10.0)
    torch.testing.assert_close(p.detach(), torch.tensor(expected, dtype=torch.float64))


def test_trust_ratio_is_per_tensor_and_clamped() -> None:
    big = _one_param([1000.0, 0.0])  # ||p|| / ||u|| ~ 1000 -> clamped to max_coeff
    tiny = _one_param([1e-6, 0.0])  # ratio ~ 1e-6 -> clamped to min_coeff
    zero = _one_param([0.0, 0.0])  # zero weights -> ratio 1, so zero-initialised biases still move
    opt = Lamb([big, tiny, zero], lr=0.1, max_coeff=10.0, min_coeff=0.01)
    for p in (big, tiny, zero):
        p.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)
    opt.step()
    assert opt.get_lamb_coeffs() == pytest.approx([10.0, 0.01, 1.0])
    assert zero[0].item() == pytest.approx(-0.1, rel=1e-6)


def test_lamb_eps_inside_sqrt() -> None:
    p = _one_param([3.0, 4.0])
    opt = Lamb([p], lr=0.1, eps=1.0, eps_inside_sqrt=True, max_coeff=1.0, min_coeff=1.0)
    p.grad = torch.tensor([2.0, 0.0], dtype=torch.float64)
    opt.step()
    # v_hat = [4, 0]; denom = sqrt(v_hat + 1) = [sqrt(5), 1]; update = [2/sqrt(5), 0]; ratio fixed at 1.
    torch.testing.assert_close(p.detach(), torch.tensor([3.0 - 0.1 * 2 / math.sqrt(5), 4.0], dtype=torch.float64))


def test_lion_step_by_hand() -> None:
    p = _one_param([1.0, -1.0, 0.5])
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([0.3, -0.2, 0.0], dtype=torch.float64)
    opt.step()
    # m = 0 so the direction is sign(g); decay multiplies p by (1 - 0.1 * 0.5) first.
    torch.testing.assert_close(p.detach(), torch.tensor([0.95 - 0.1, -0.95 + 0.1, 0.475], dtype=torch.float64))
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor([0.003, -0.002, 0.0], dtype=torch.float64))
