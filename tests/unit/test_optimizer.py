"""engine/train/optimizer.py: param groups, implementation flags, errors."""

import types

import pytest
import torch
from torch import nn

from engine.train.optimizer import build_optimizer


def _cfg(**overrides):
    values = dict(name="AdamW", lr=8e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                  implementation="foreach")
    values.update(overrides)
    return types.SimpleNamespace(**values)


class _Tiny(nn.Module):
    """Embedding (2-D), linear with bias (2-D + 1-D), norm (1-D)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def _groups(opt):
    return {g["name"]: g for g in opt.param_groups}


def test_decay_only_on_matrices():
    model = _Tiny()
    opt = build_optimizer([model], _cfg())
    assert isinstance(opt, torch.optim.AdamW)
    groups = _groups(opt)
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert {id(p) for p in groups["decay"]["params"]} == {id(model.emb.weight), id(model.proj.weight)}
    assert {id(p) for p in groups["no_decay"]["params"]} == {
        id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)
    }
    assert groups["decay"]["weight_decay"] == 0.1
    assert groups["no_decay"]["weight_decay"] == 0.0
    for g in opt.param_groups:
        assert g["lr"] == 8e-4 and g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8


def test_all_parts_in_one_optimizer_and_shared_param_once():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight  # tied across parts: must be optimized once
    frozen = nn.Linear(3, 3)
    frozen.requires_grad_(False)
    opt = build_optimizer([a, b, frozen], _cfg())
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 3  # a.weight, a.bias, b.bias
    assert len({id(p) for p in params}) == 3


def test_weight_decay_changes_only_matrices():
    """One step with zero gradients: only decayed params move (AdamW decoupled decay)."""
    model = _Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer([model], _cfg(lr=0.1, weight_decay=0.5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == (p.ndim >= 2), name


@pytest.mark.parametrize("impl, foreach, fused", [
    ("foreach", True, False), ("fused", False, True), ("for-loop", False, False),
    ("auto", False, True),  # CPU fp32 has the fused kernel, so auto picks it
])
def test_implementation_flags(impl, foreach, fused):
    model = nn.Linear(4, 4)
    opt = build_optimizer([model], _cfg(implementation=impl))
    assert all(g["foreach"] is foreach and g["fused"] is fused for g in opt.param_groups)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # every implementation must run on CPU in torch 2.13


def test_auto_falls_back_to_foreach_without_fused_kernel():
    model = nn.Linear(2, 2, device="meta")  # no fused kernel on the meta device
    opt = build_optimizer([model], _cfg(implementation="auto"))
    assert all(g["foreach"] is True and g["fused"] is False for g in opt.param_groups)


def test_implementations_agree():
    """Fused (the default on CPU and CUDA) against torch's reference for-loop, over 5 steps."""
    results = []
    for impl in ("foreach", "fused", "for-loop"):
        torch.manual_seed(0)
        model = _Tiny()
        opt = build_optimizer([model], _cfg(implementation=impl))
        for _ in range(5):
            model.proj(model.norm(model.emb(torch.tensor([1, 2, 3])))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])


def test_adam_has_no_weight_decay(caplog):
    opt = build_optimizer([_Tiny()], _cfg(name="Adam", weight_decay=0.1))
    assert type(opt) is torch.optim.Adam
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    assert "optimizer.weight_decay=0.1 is ignored" in caplog.text


def test_fused_rejects_unsupported_params():
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="optimizer.implementation='fused'"):
        build_optimizer([model], _cfg(implementation="fused"))


@pytest.mark.parametrize("overrides, match", [
    ({"name": "SGD"}, r"optimizer.name='SGD'.*\['AdamW', 'Adam', 'Muon'\]"),
    ({"implementation": "cuda-graph"}, r"optimizer.implementation='cuda-graph'.*foreach"),
    ({"lr": 0.0}, "optimizer.lr=0.0"),
    ({"beta2": 1.0}, "optimizer.beta2=1.0"),
    ({"eps": -1.0}, "optimizer.eps=-1.0"),
    ({"weight_decay": -0.1}, "optimizer.weight_decay=-0.1"),
])
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer([nn.Linear(2, 2)], _cfg(**overrides))


def test_no_trainable_params():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad"):
        build_optimizer([frozen], _cfg())
    with pytest.raises(ValueError, match="empty model_parts"):
        build_optimizer([], _cfg())
