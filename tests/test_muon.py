"""Muon (engine/train/muon.py) and param group rules (engine/train/param_groups.py), one process: the
step equals a plain loop of torch.optim.Muon + torch.optim.AdamW bitwise; the rules' counts, refusals
and learning-rate multipliers. The layouts' parity is in tests/test_muon_parallel.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from engine.config.schema import OptimizerSection
from engine.train.optimizer import build_optimizer
from engine.train.param_groups import ParamGroupError


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(32, 48, bias=False)   # wide: [48, 32] is transposed by NS
        self.attention.wo = nn.Linear(48, 32, bias=True)    # a bias: AdamW, no decay
        self.attention_norm = nn.RMSNorm(32)
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.gate = nn.Linear(32, 4, bias=False)  # a matrix that stays on AdamW
        self.moe.experts = nn.Module()
        self.moe.experts.w1 = nn.Parameter(torch.randn(4, 32, 24) * 0.1)  # per-expert matrices


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.norm = nn.RMSNorm(32)
        self.output = nn.Linear(32, 64, bias=False)


def _cfg(**overrides) -> OptimizerSection:
    cfg = OptimizerSection(name="Muon", lr=0.02, weight_decay=0.1, implementation="for-loop")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def _oracle_step(model, grads, muon, adamw, experts) -> None:
    """torch.optim.Muon on the 2-D hidden matrices and on each expert's slice, AdamW on the rest."""
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    for name, slices in experts.items():
        for i, s in enumerate(slices):
            s.grad = grads[name][i].clone()
    muon.step()
    adamw.step()
    with torch.no_grad():
        for name, slices in experts.items():
            model.get_parameter(name).copy_(torch.stack([s.detach() for s in slices]))


@pytest.mark.parametrize("nesterov, adjust", [(True, "match_rms_adamw"), (False, "original")])
def test_muon_step_is_torch_muon_plus_adamw_bitwise(nesterov, adjust):
    torch.manual_seed(0)
    model = _Model()
    reference = copy.deepcopy(model)
    cfg = _cfg(muon_nesterov=nesterov, muon_adjust_lr=adjust)
    optimizer = build_optimizer([model], cfg)
    assert [g["name"] for g in optimizer.param_groups] == ["muon", "decay", "no_decay"]

    hidden = [p for n, p in reference.named_parameters() if n.endswith(("wq.weight", "wo.weight"))]
    experts = {n: [nn.Parameter(p.detach()[i].clone()) for i in range(p.shape[0])]
               for n, p in reference.named_parameters() if n.endswith("experts.w1")}
    matrices = [n for n, p in reference.named_parameters() if p.ndim == 2 and not n.endswith(("wq.weight", "wo.weight"))]
    vectors = [p for p in reference.parameters() if p.ndim == 1]
    muon = torch.optim.Muon(hidden + [s for slices in experts.values() for s in slices], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=nesterov,
                            adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([{"params": [reference.get_parameter(n) for n in matrices], "weight_decay": 0.1},
                               {"params": vectors, "weight_decay": 0.0}], lr=cfg.lr,
                              betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False, fused=False)
    for step in range(3):
        grads = _grads(model, step)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        optimizer.step()
        _oracle_step(reference, grads, muon, adamw, experts)
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(got, want), (step, name, (got - want).abs().max())
    assert all("momentum_buffer" in optimizer.state[p] for p in model.parameters() if p.ndim == 3)
