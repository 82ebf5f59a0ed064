"""Gradient clipping on one process: both sides of the threshold (parallelisms/grad_norm.py).

The multi-rank reductions of the norm are checked in tests/integration/test_tensor_parallel.py and by every
parity layout; here the rule itself, as torch.nn.utils.clip_grad_norm_ defines it: gradients are
scaled by min(1, max_norm / (norm + 1e-6)), so a norm under the threshold leaves them untouched.
"""

from __future__ import annotations

import pytest
import torch

from parallelisms.grad_norm import clip_grad_norm_


def _params(scale: float) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(8, 6)), torch.nn.Parameter(torch.zeros(6))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * scale
    return params


def _norm(params) -> float:
    return float(torch.stack([p.grad.double().norm() for p in params]).norm())


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "one_by_one"])
@pytest.mark.parametrize("max_norm_over_norm", [1.5, 1.0 + 1e-3, 20.0], ids=["below", "just_below", "far_below"])
def test_norm_below_max_norm_leaves_gradients_bitwise(foreach, max_norm_over_norm):
    params = _params(0.1)
    norm = _norm(params)
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm_(params, max_norm=norm * max_norm_over_norm, foreach=foreach)
    assert total.item() == pytest.approx(norm, rel=1e-6)
    for param, grad in zip(params, before):
        assert torch.equal(param.grad, grad)  # not scaled up towards max_norm


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "one_by_one"])
def test_norm_above_max_norm_is_scaled_to_it(foreach):
    params = _params(1.0)
    norm = _norm(params)
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm_(params, max_norm=norm / 4, foreach=foreach)
    assert total.item() == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    assert _norm(params) == pytest.approx(norm / 4, rel=1e-5)
    for param, grad in zip(params, before):
        torch.testing.assert_close(param.grad, grad * (norm / 4) / (norm + 1e-6))


def test_max_norm_zero_only_measures():
    params = _params(1.0)
    before = [p.grad.clone() for p in params]
    assert clip_grad_norm_(params, max_norm=0.0).item() == pytest.approx(_norm(params), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
