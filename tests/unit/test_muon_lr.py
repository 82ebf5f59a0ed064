"""optimizer.muon_lr (issue #48): Muon's matrices train at their own lr, the AdamW part of a Muon run at
optimizer.lr, and AdamW runs keep their param groups, schedule and fingerprint. The defaults are the
measured ones of engine/docs/optimizers.md (scripts/benchmarks/muon_lr.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.config.fingerprint import fingerprint
from engine.config.schema import LRSchedulerSection, OptimizerSection
from engine.train.lr_scheduler import build_lr_scheduler, lr_factor
from engine.train.optimizer import build_optimizer
from tests.integration.test_fingerprint import _tables  # the default config as TOML tables, with section__key changes


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 16)
        self.layers = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(2)})  # Muon weights, AdamW biases
        self.norm = nn.RMSNorm(16)
        self.output = nn.Linear(16, 64, bias=False)


def _lrs(name: str, **overrides) -> dict[str, float]:
    cfg = OptimizerSection(name=name, lr=8e-4, implementation="for-loop", **overrides)
    return {g["name"]: g["lr"] for g in build_optimizer([_Model()], cfg).param_groups}


def test_the_measured_defaults():
    cfg = OptimizerSection()
    assert (cfg.lr, cfg.muon_lr, cfg.muon_adjust_lr, LRSchedulerSection().warmup_steps) == (
        8e-4, 2e-2, "match_rms_adamw", 10)


def test_muon_matrices_take_muon_lr_and_the_adamw_part_optimizer_lr():
    assert _lrs("Muon") == {"muon": 2e-2, "decay": 8e-4, "no_decay": 8e-4}
    assert _lrs("Muon", muon_lr=5e-3) == {"muon": 5e-3, "decay": 8e-4, "no_decay": 8e-4}
    # a rule's lr_mult multiplies whichever lr its parameters take
    assert _lrs("Muon", muon_lr=5e-3, param_groups=["layers.0.* lr_mult=0.5"]) == {
        "rule0.muon.decay": 2.5e-3, "rule0.adamw.no_decay": 4e-4, "muon": 5e-3, "decay": 8e-4, "no_decay": 8e-4}


def test_adamw_runs_are_unchanged_by_muon_lr():
    for name in ("AdamW", "Adam"):
        groups = [build_optimizer([_Model()], OptimizerSection(name=name, lr=8e-4, muon_lr=muon_lr)).param_groups
                  for muon_lr in (2e-2, 1.0)]
        for group, other in zip(*groups):
            assert group["lr"] == other["lr"] == 8e-4 and "lr_scale" not in group
            assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in other.items() if k != "params"}


def test_the_schedule_scales_both_lrs_alike():
    """Warmup and decay multiply each group's peak; min_lr is optimizer.lr's, so Muon's floor is
    min_lr x muon_lr / lr."""
    schedule = LRSchedulerSection(warmup_steps=3, decay_type="cosine", min_lr=8e-5)
    optimizer = build_optimizer([_Model()], OptimizerSection(name="Muon", lr=8e-4, muon_lr=2e-2,
                                                            param_groups=["layers.0.* lr_mult=0.5"]))
    scheduler = build_lr_scheduler(optimizer, schedule, training_steps=10)
    for step in range(1, 11):
        factor = lr_factor(step, warmup_steps=3, decay_type="cosine", decay_ratio=0.2, training_steps=10,
                           lr=8e-4, min_lr=8e-5)
        want = {"rule0.muon.decay": 1e-2, "rule0.adamw.no_decay": 4e-4, "muon": 2e-2, "decay": 8e-4,
                "no_decay": 8e-4}
        for group in optimizer.param_groups:
            assert math.isclose(group["lr"], want[group["name"]] * factor, rel_tol=1e-12), (step, group["name"])
        optimizer.step()
        scheduler.step()
    assert math.isclose(optimizer.param_groups[2]["lr"], 8e-5 * 2e-2 / 8e-4, rel_tol=1e-12)


def test_fingerprint_hashes_muon_lr_only_under_muon():
    old = _tables()
    del old["optimizer"]["muon_lr"]  # a config written before the key existed
    for muon_lr in (2e-2, 1e-3):  # AdamW: the key acts on nothing, the fingerprint stays the old one
        assert fingerprint(_tables(optimizer__muon_lr=muon_lr)) == fingerprint(old)
    muon = {muon_lr: fingerprint(_tables(optimizer__name="Muon", optimizer__muon_lr=muon_lr)) for muon_lr in (2e-2, 1e-3)}
    old["optimizer"]["name"] = "Muon"
    # Muon: another muon_lr is another run, and a Muon run before the key (matrices at optimizer.lr) too
    assert len({muon[2e-2], muon[1e-3], fingerprint(old)}) == 3


@pytest.mark.parametrize("muon_lr", [0.0, -1e-3])
def test_a_bad_muon_lr_is_refused(muon_lr):
    with pytest.raises(ValueError, match="optimizer.muon_lr"):
        build_optimizer([_Model()], OptimizerSection(name="Muon", muon_lr=muon_lr))


def test_a_muon_step_moves_a_matrix_by_its_own_lr():
    """One step, weight decay 0: the Muon matrices' update scales with muon_lr, the rest's with lr."""
    deltas = []
    for muon_lr in (1e-2, 2e-2):
        torch.manual_seed(0)
        model = _Model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = build_optimizer([model], OptimizerSection(name="Muon", lr=8e-4, muon_lr=muon_lr, weight_decay=0.0,
                                                              muon_ns_dtype="float32"))
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    for n in deltas[0]:
        ratio = 2.0 if n.startswith("layers.") and n.endswith("weight") else 1.0
        torch.testing.assert_close(deltas[1][n], deltas[0][n] * ratio, rtol=1e-4, atol=1e-6, msg=n)


def test_the_log_says_which_lr_each_part_takes(caplog):
    """A Muon run's start-up names both peak lrs and which one the step lines log (a new user's trial:
    the step lines showed 2e-2 with nothing saying it was the Muon matrices')."""
    import logging

    with caplog.at_level(logging.INFO):
        optimizer = build_optimizer([_Model()], OptimizerSection(name="Muon", lr=8e-4, muon_lr=3e-2))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Muon: "))
    assert "optimizer.muon_lr = 0.03" in line and "optimizer.lr = 0.0008" in line, line
    assert f"log the {optimizer.param_groups[0]['name']} group's lr" in line, line
