"""engine/config/param_groups.py's rules, each against an oracle of its own: the grammar and defaults its
module docstring states, torch's own wrapper modules (checkpoint_wrapper, torch.compile, DataParallel)
for the wrapper-free names, and an exhaustive enumeration of ``group_key`` for the group layout
``group_keys`` promises. Unit level: no model is trained (< 1 s)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import engine.config.param_groups as pg
from engine.config.param_groups import ParamGroupError, clean_name, group_key, group_keys, parse_rules
from engine.config.schema import OptimizerSection
from engine.train.optimizer import SUPPORTED_OPTIMIZERS, build_optimizer

# The rule grammar as the module docstring (the user's reference) writes it.
GRAMMAR = re.search(r'``"(PATTERN [^"]*)"``', pg.__doc__).group(1)
FIELDS = re.findall(r"\[(\w+=[\w|]+)\]", GRAMMAR)  # ["lr_mult=F", "weight_decay=F", "optimizer=muon|adamw"]


class _Tiny(nn.Module):
    """Embedding, a hidden matrix with a bias, a 3-D expert stack, a norm gain, an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)
        self.experts = nn.Parameter(torch.randn(2, 4, 4))
        self.norm = nn.RMSNorm(4)
        self.output = nn.Linear(4, 8, bias=False)


def _cfg(name: str, rules: list[str]) -> OptimizerSection:
    return OptimizerSection(name=name, lr=1e-3, muon_lr=2e-2, weight_decay=0.1, implementation="for-loop",
                            param_groups=rules)


def _refusal(call) -> str:
    with pytest.raises(ParamGroupError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_docstring_grammar_is_what_the_parser_reads():
    assert FIELDS == ["lr_mult=F", "weight_decay=F", "optimizer=muon|adamw"]
    rule, = parse_rules(["w lr_mult=0.5 weight_decay=0.25 optimizer=adamw"], "Muon")
    assert (rule.pattern, rule.lr_mult, rule.weight_decay, rule.optimizer) == ("w", 0.5, 0.25, "adamw")


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_an_omitted_lr_mult_keeps_the_run_peak_lr(name):
    """Docstring: an omitted field keeps the default, lr_mult 1, so a rule that only sets a weight decay
    leaves each of its groups at the lr it would have without the rule (optimizer.lr; muon_lr for Muon's)."""
    rules = ["proj.weight weight_decay=0", "experts weight_decay=0"]
    groups = {g["name"]: g for g in build_optimizer([_Tiny()], _cfg(name, rules)).param_groups}
    expected = 2e-2 if name == "Muon" else 1e-3
    assert groups[f"rule0.{'muon' if name == 'Muon' else 'adamw'}"]["lr"] == expected
    assert groups[f"rule0.{'muon' if name == 'Muon' else 'adamw'}"]["weight_decay"] == 0


def test_optimizer_muon_is_accepted_exactly_under_muon():
    assert parse_rules(["proj.weight optimizer=muon"], "Muon")[0].optimizer == "muon"
    for name in ("AdamW", "Adam"):
        message = _refusal(lambda: parse_rules(["proj.weight optimizer=muon"], name))
        assert "'proj.weight optimizer=muon'" in message and 'optimizer.name = "Muon"' in message


@pytest.mark.parametrize("name", SUPPORTED_OPTIMIZERS)
def test_a_weight_decay_is_refused_only_under_adam(name):
    """Adam has no (decoupled) weight decay; a rule setting one to a non-zero value is refused there only."""
    assert parse_rules(["proj.weight weight_decay=0"], name)[0].weight_decay == 0
    if name != "Adam":
        assert parse_rules(["proj.weight weight_decay=0.3"], name)[0].weight_decay == 0.3
        return
    message = _refusal(lambda: parse_rules(["proj.weight weight_decay=0.3"], "Adam"))
    fixed = re.findall(r'optimizer\.name = "(\w+)"', message)[-1]  # the fix: a name that decays
    assert fixed in SUPPORTED_OPTIMIZERS and parse_rules(["proj.weight weight_decay=0.3"], fixed)
    assert message.startswith("optimizer.param_groups rule 'proj.weight weight_decay=0.3'")
    assert message.endswith(f'use optimizer.name = "{fixed}" or drop weight_decay')


@pytest.mark.parametrize("text, ending", [
    ("   ", f'write "{GRAMMAR}"'),
    ("proj.weight lr=2", ", ".join(FIELDS) + " (each at most once)"),
    ("proj.weight lr_mult=1 lr_mult=2", ", ".join(FIELDS) + " (each at most once)"),
    ("proj.weight weight_decay=-0.1", "weight_decay=-0.1 must be >= 0"),
    ("proj.weight lr_mult=0", "lr_mult=0.0 must be > 0"),
    ("proj.weight optimizer=sgd", "optimizer=sgd is not muon or adamw"),
])
def test_a_refusal_names_the_rule_and_ends_with_the_grammar(text, ending):
    """One line naming the rule as written and ending with what a valid rule looks like (the grammar the
    module docstring gives)."""
    message = _refusal(lambda: parse_rules(["norm.weight", text], "Muon"))
    assert repr(text) in message and message.endswith(ending)


def test_an_unmatched_rule_names_three_real_parameter_names():
    names = [n for n, _ in _Tiny().named_parameters()]
    message = _refusal(lambda: build_optimizer([_Tiny()], _cfg("AdamW", ["layers.*"])))
    assert "'layers.*' matches no parameter" in message and message.endswith(", ".join(names[:3]))


def test_clean_name_is_the_name_without_torchs_wrappers():
    """Oracle: the names torch's own wrappers give (activation checkpointing, torch.compile, DataParallel)
    are the plain module's names once cleaned."""
    plain = nn.ModuleDict({"0": _Tiny(), "1": _Tiny()})
    wrapped = nn.ModuleDict({"0": checkpoint_wrapper(_Tiny()), "1": _Tiny()})
    expected = [n for n, _ in plain.named_parameters()]
    for module in (wrapped, torch.compile(wrapped), nn.DataParallel(torch.compile(wrapped))):
        names = [n for n, _ in module.named_parameters()]
        assert names != expected and [clean_name(n) for n in names] == expected
    assert clean_name("layers.3._fsdp_wrapped_module.w1") == "layers.3.w1"


def _reachable(rules, optimizer_name) -> set:
    """Every key group_key gives, over names that hit each rule, the AdamW matrices and a hidden one."""
    keys = set()
    for name in ("a.w", "b.w", "c.w", "tok_embeddings.weight", "output.weight", "layers.0.router.gate", "h.w",
                 "m.w"):
        for ndim in (0, 1, 2, 3, 4):
            try:
                keys.add(group_key(name, ndim, rules, optimizer_name))
            except ParamGroupError:  # optimizer=muon on a vector: refused (test below)
                pass
    return keys


@pytest.mark.parametrize("optimizer_name", SUPPORTED_OPTIMIZERS)
def test_group_keys_are_exactly_the_keys_a_parameter_can_get(optimizer_name):
    """group_keys lists each group a run can have, none that no parameter could fill (an empty group
    stays in the optimizer's layout on every pipeline stage), rules' first in rule order."""
    last = "m.* optimizer=muon" if optimizer_name == "Muon" else "m.* optimizer=adamw weight_decay=0"
    rules = parse_rules(["a.* weight_decay=0", "b.* lr_mult=2", "c.* optimizer=adamw", last], optimizer_name)
    keys = group_keys(rules, optimizer_name)
    assert len(keys) == len(set(keys)) and set(keys) == _reachable(rules, optimizer_name)
    order = [-1 if index is None else index for index, _, _ in keys]
    assert [i for i in order if i >= 0] == sorted(i for i in order if i >= 0) and order[-1] == -1


def test_optimizer_muon_on_a_vector_is_refused_in_one_line():
    """Muon orthogonalises matrices: a rule giving it a norm gain is refused, naming rule and parameter,
    by the optimizer and by the pre-flight (it was a KeyError inside build_optimizer)."""
    from engine.config import load_config
    from engine.setup.preflight import check_setup

    message = _refusal(lambda: build_optimizer([_Tiny()], _cfg("Muon", ["norm.* optimizer=muon"])))
    assert "'norm.* optimizer=muon'" in message and "norm.weight, a 1-D parameter" in message
    assert "2-D matrices and 3-D expert weights" in message  # what Muon takes (engine/train/muon.py)
    groups = build_optimizer([_Tiny()], _cfg("Muon", ["proj.weight optimizer=muon", "experts optimizer=muon"]))
    assert [g["name"] for g in groups.param_groups][:2] == ["rule0.muon.decay", "rule1.muon.decay"]
    cfg = load_config(["--model.flavor", "debugmodel_tiny", "--optimizer.name", "Muon",
                       "--optimizer.param_groups", "norm.* optimizer=muon"])
    assert "norm.weight, a 1-D parameter" in _refusal(lambda: check_setup(cfg, 1, "cpu", check_data=False))
