"""Muon (engine/train/muon.py) and param group rules (engine/config/param_groups.py), one process: the
step equals a plain loop of torch.optim.Muon + torch.optim.AdamW bitwise; the rules' counts, refusals
and learning-rate multipliers. The layouts' parity is in tests/integration/test_muon_parallel.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from engine.config.schema import OptimizerSection
from engine.train.optimizer import build_optimizer
from engine.config.param_groups import ParamGroupError


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
    cfg = _cfg(muon_nesterov=nesterov, muon_adjust_lr=adjust, muon_lr=0.05)  # Muon's matrices: their own lr
    optimizer = build_optimizer([model], cfg)
    assert [g["name"] for g in optimizer.param_groups] == ["muon", "decay", "no_decay"]

    hidden = [p for n, p in reference.named_parameters() if n.endswith(("wq.weight", "wo.weight"))]
    experts = {n: [nn.Parameter(p.detach()[i].clone()) for i in range(p.shape[0])]
               for n, p in reference.named_parameters() if n.endswith("experts.w1")}
    matrices = [n for n, p in reference.named_parameters() if p.ndim == 2 and not n.endswith(("wq.weight", "wo.weight"))]
    vectors = [p for p in reference.parameters() if p.ndim == 1]
    muon = torch.optim.Muon(hidden + [s for slices in experts.values() for s in slices], lr=cfg.muon_lr,
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


def test_param_group_rules_take_counts_and_log_them_once(caplog):
    """First match wins: rule 2 ("layers.*") gets only what rules 0 and 1 left of the blocks."""
    rules = ["tok_embeddings.weight lr_mult=0.5 weight_decay=0", "layers.*.attention.w* optimizer=adamw",
             "layers.* lr_mult=2"]
    with caplog.at_level(logging.INFO, logger="quadra"):
        optimizer = build_optimizer([_Model()], _cfg(param_groups=rules))
    names = {g["name"]: len(g["params"]) for g in optimizer.param_groups}
    # rule 1: wq, wo (decay) and wo's bias (no decay) of both blocks; rule 2: the experts (Muon), the
    # routers (AdamW matrices), the norms; the default: the output head and the final norm.
    assert names == {"rule0.adamw": 1, "rule1.adamw.decay": 4, "rule1.adamw.no_decay": 2, "rule2.muon.decay": 2,
                     "rule2.adamw.decay": 2, "rule2.adamw.no_decay": 2, "decay": 1, "no_decay": 1}, names
    lines = [r.getMessage() for r in caplog.records if "param groups" in r.getMessage()]
    assert len(lines) == 1, lines
    for part in ("rule 0 (tok_embeddings.weight) adamw: 1 parameters", "rule 1 (layers.*.attention.w*) adamw: 6 "
                 "parameters", "rule 2 (layers.*) muon: 2 parameters", "rule 2 (layers.*) adamw: 4 parameters",
                 "default adamw: 2 parameters"):
        assert part in lines[0], (part, lines[0])
    group = next(g for g in optimizer.param_groups if g["name"] == "rule0.adamw")
    assert group["lr"] == 0.01 and group["lr_mult"] == 0.5 and group["weight_decay"] == 0


@pytest.mark.parametrize("rule, words", [
    ("layers.*.atention.wq.weight", "matches no parameter"),          # a typo: no silent default
    ("output.weight lr=2", "is not one of lr_mult=F"),
    ("output.weight optimizer=sgd", "is not muon or adamw"),
    ("output.weight lr_mult=0", "must be > 0"),
])
def test_a_bad_or_unmatched_rule_is_refused_in_one_line(rule, words):
    with pytest.raises(ParamGroupError, match=words) as error:
        build_optimizer([_Model()], _cfg(param_groups=["output.weight", rule]))
    assert "\n" not in str(error.value)


def test_unmatched_rule_is_refused_by_the_preflight_and_the_config():
    from engine.config import ConfigError, load_config
    from engine.setup.preflight import check_setup

    cfg = load_config(["--model.flavor", "debugmodel_tiny", "--optimizer.param_groups", "layers.*.atention.*"])
    with pytest.raises(ParamGroupError, match="'layers.*.atention.*' matches no parameter"):
        check_setup(cfg, 1, "cpu", check_data=False)
    with pytest.raises(ConfigError, match="optimizer=muon needs"):
        load_config(["--optimizer.param_groups", "output.weight optimizer=muon"]).validate()


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_lr_multiplier_is_seen_in_the_applied_update(name):
    """Same gradients, weight decay 0: the update of a rule's parameters is lr_mult x the default's, also
    after the LR scheduler (which keeps the multiplier: every group peaks at lr_mult x optimizer.lr)."""
    from engine.config.schema import LRSchedulerSection
    from engine.train.lr_scheduler import build_lr_scheduler

    deltas = []
    for rules in ([], ["layers.0.* lr_mult=0.25"]):
        torch.manual_seed(0)
        model = _Model()
        optimizer = build_optimizer([model], _cfg(name=name, weight_decay=0.0, param_groups=rules))
        scheduler = build_lr_scheduler(optimizer, LRSchedulerSection(warmup_steps=2), training_steps=10)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(3):
            for n, p in model.named_parameters():
                p.grad = _grads(model, step)[n]
            optimizer.step()
            scheduler.step()
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    for n in deltas[0]:
        want = deltas[0][n] * (0.25 if n.startswith("layers.0.") else 1.0)
        torch.testing.assert_close(deltas[1][n], want, rtol=1e-4, atol=1e-7, msg=n)


RULES = "tok_embeddings.weight lr_mult=0.5,layers.0.* optimizer=adamw"  # a mixed split (comma: two rules)


@pytest.mark.parametrize("model_name", ["llama", "moe"])
def test_planner_optimizer_bytes_are_the_real_state(model_name):
    """engine/planner's optimizer bytes for Muon with mixed groups equal, byte for byte, the tensors a
    real optimizer holds after a step (momentum buffers, Adam moments and steps), one process."""
    from engine.config import load_config
    from engine.planner.layout import Layout
    from engine.planner.memory import state_bytes
    from tests.training_utils import base_args

    cfg = load_config(base_args("/tmp/unused", {"model.name": model_name, "optimizer.name": "Muon",
                                                "optimizer.param_groups": RULES, "training.global_batch_size": -1}))
    cfg.validate()
    layout = Layout.from_config(cfg, 1, "cpu")
    spec = layout.model_spec
    model = spec.get("model_cls")(layout.model_args)
    optimizer = build_optimizer([model], cfg.optimizer)
    assert {g["name"] for g in optimizer.param_groups} >= {"rule0.adamw.decay", "rule1.adamw.decay", "muon"}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    real = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))
    assert state_bytes(layout).optimizer == real


@pytest.mark.parametrize("world, overrides", [
    (4, {"parallelism.dp_shard": 2, "parallelism.tp": 2}),
    (2, {"model.name": "moe", "parallelism.dp_shard": 2, "parallelism.ep": 2}),
])
def test_planner_optimizer_bytes_equal_the_real_plan_under_muon(world, overrides):
    from engine.config import load_config
    from engine.planner.layout import Layout
    from engine.planner.memory import state_bytes
    from tests.planner_runs import real_plan_states
    from tests.training_utils import base_args

    cfg = load_config(base_args("/tmp/unused", {"optimizer.name": "Muon", "optimizer.param_groups": RULES,
                                                "training.global_batch_size": -1, **overrides}))
    cfg.validate()
    layout = Layout.from_config(cfg, world, "cpu")
    for rank, (coords, real) in enumerate(real_plan_states(cfg, world, list(range(world)))):
        assert state_bytes(layout, coords) == real, (rank, coords)


def test_planner_counts_muon_gathers_and_broadcasts_per_mesh_dim():
    """fsdp2 x tp2: every hidden matrix is sharded over tp and over FSDP, so each dim gathers and
    broadcasts every whole matrix once per step (fp32 on the wire); AdamW has no broadcast."""
    import math

    from engine.config import load_config
    from engine.planner.comm import comm_bytes
    from engine.planner.layout import Layout
    from tests.training_utils import base_args

    def comm(name):
        cfg = load_config(base_args("/tmp/unused", {"optimizer.name": name, "parallelism.dp_shard": 2,
                                                    "parallelism.tp": 2, "training.global_batch_size": -1}))
        layout = Layout.from_config(cfg, 4, "cpu")
        return layout, comm_bytes(layout)

    layout, muon = comm("Muon")
    _, adamw = comm("AdamW")
    hidden = sum(math.prod(p.shape) for p in layout.params if p.layer is not None and len(p.shape) == 2)
    for dim in ("tp", "dp_shard_cp"):
        assert muon[dim]["kinds"]["broadcast"] == 4 * hidden and "broadcast" not in adamw[dim]["kinds"]
        assert muon[dim]["kinds"]["all_gather"] - adamw[dim]["kinds"].get("all_gather", 0) == 4 * hidden


@pytest.mark.parametrize("overrides, words", [
    (["--optimizer.muon_lr", "0"], "optimizer.muon_lr = 0.0: must be > 0"),
    (["--optimizer.muon_momentum", "1.5"], "optimizer.muon_momentum = 1.5: must be in [0, 1)"),
    (["--optimizer.muon_ns_coefficients", "3.4,-4.7"], "optimizer.muon_ns_coefficients"),
    (["--optimizer.muon_ns_steps", "0"], "optimizer.muon_ns_steps = 0"),
    (["--loss.z_loss_weight", "-1"], "loss.z_loss_weight = -1"),
    (["--loss.z_loss_weight", "1e-4", "--parallelism.tp", "2", "--loss.chunk_tokens", "0"], "needs the fused loss"),
])
def test_bad_muon_and_z_loss_settings_are_refused_in_one_line(overrides, words):
    from engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")) as error:
        load_config(overrides).validate()
    assert "\n" not in str(error.value)



def test_the_docs_parameter_group_example_passes_the_preflight_as_written():
    """engine/docs/optimizers.md's ``param_groups`` TOML block, as written, on the MoE config it names: every rule matches
    a parameter (its expert rule once named ``layers.*.moe.experts.*``, which no family has, and the
    pre-flight refused the example)."""
    import os
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    from engine.config import load_config
    from engine.setup.preflight import check_setup
    from tests.training_utils import REPO

    with open(os.path.join(REPO, "engine", "docs", "optimizers.md"), encoding="utf-8") as f:
        blocks = [b for b in re.findall(r"```toml\n(.*?)```", f.read(), flags=re.S) if "param_groups" in b]
    assert blocks, "engine/docs/optimizers.md has no param_groups example"
    for block in blocks:
        section = tomllib.loads(block)["optimizer"]
        cfg = load_config(["--job.config_file", os.path.join(REPO, "train_configs", "debug_moe.toml"),
                           "--optimizer.name", section["name"],
                           "--optimizer.param_groups", ",".join(section["param_groups"])])
        cfg.validate()
        check_setup(cfg, 4, "cpu", check_data=False)  # raises on a rule that matches nothing (its dp 2 x 2)
