"""Which optimizer, learning rate and weight decay each parameter gets: ``optimizer.param_groups`` rules.

Torch-free (names and shapes only), so the launcher's pre-flight refuses a rule that matches nothing
before any rank starts, from the family's ``ParamSpec`` names (models/common/planning.py).

A rule is one string ``"PATTERN [lr_mult=F] [weight_decay=F] [optimizer=muon|adamw]"``: PATTERN is an
``fnmatch`` pattern over canonical parameter names (``named_parameters`` without wrapper components,
e.g. ``layers.*.attention.wq.weight``, ``tok_embeddings.weight``); the first rule whose pattern
matches a parameter takes it; parameters no rule takes follow the default. An omitted field keeps the
default: ``lr_mult`` 1, the weight decay policy by shape (GPT-3, Brown et al. 2020, App. B: matrices
decay, vectors do not), and the run's optimizer classification (below).

Default classification with ``optimizer.name = "Muon"`` (Jordan et al. 2024; Liu et al. 2025, Sec. 2):
Muon for the hidden weight matrices (2-D, and 3-D ``[experts, rows, cols]`` MoE expert weights),
AdamW for everything else: the embedding and output head (Muon's authors keep them on AdamW: their
rows are per-token, not a linear map to orthogonalise), the router, norm gains, biases, QK-norm.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

# Matrices that stay on AdamW under Muon (canonical names of models/llama, models/moe, models/qwen3).
ADAMW_MATRICES = ("tok_embeddings.weight", "output.weight", "*.router.*")
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module")
ALGORITHMS = ("muon", "adamw")


class ParamGroupError(ValueError):
    """A bad ``optimizer.param_groups`` rule: one line naming the rule and the fix."""


@dataclass(frozen=True)
class Rule:
    """One parsed rule: ``pattern``; ``lr_mult`` (x optimizer.lr); ``weight_decay`` (None: the
    default policy); ``optimizer`` (None: the default classification); ``text`` as written."""

    pattern: str
    lr_mult: float = 1.0
    weight_decay: float | None = None
    optimizer: str | None = None
    text: str = ""


def parse_rules(texts: list[str], optimizer_name: str) -> list[Rule]:
    """Parse ``optimizer.param_groups``.

    Raises:
        ParamGroupError: an unknown or malformed field, ``lr_mult <= 0``, ``weight_decay < 0``,
            ``optimizer=muon`` without ``optimizer.name = "Muon"``, a weight decay under ``Adam``.
    """
    rules = []
    for text in texts:
        words = text.split()
        if not words:
            raise ParamGroupError(f"optimizer.param_groups has an empty rule {text!r}; write "
                                  '"PATTERN [lr_mult=F] [weight_decay=F] [optimizer=muon|adamw]"')
        fields: dict = {}
        for word in words[1:]:
            # (rpartition is equivalent: a word with two "=" is refused either way, by its key or its value)
            key, sep, value = word.partition("=")
            try:
                if not sep or key not in ("lr_mult", "weight_decay", "optimizer") or key in fields:
                    raise ValueError
                fields[key] = value if key == "optimizer" else float(value)
            except ValueError:
                raise ParamGroupError(f"optimizer.param_groups rule {text!r}: {word!r} is not one of lr_mult=F, "
                                      "weight_decay=F, optimizer=muon|adamw (each at most once)") from None
        rule = Rule(words[0], fields.get("lr_mult", 1.0), fields.get("weight_decay"), fields.get("optimizer"), text)
        _check_rule(rule, optimizer_name)
        rules.append(rule)
    return rules


def _check_rule(rule: Rule, optimizer_name: str) -> None:
    where = f"optimizer.param_groups rule {rule.text!r}"
    if not rule.lr_mult > 0:
        raise ParamGroupError(f"{where}: lr_mult={rule.lr_mult} must be > 0")
    if rule.weight_decay is not None and rule.weight_decay < 0:
        raise ParamGroupError(f"{where}: weight_decay={rule.weight_decay} must be >= 0")
    if rule.optimizer is not None and rule.optimizer not in ALGORITHMS:
        raise ParamGroupError(f"{where}: optimizer={rule.optimizer} is not muon or adamw")
    if rule.optimizer == "muon" and optimizer_name != "Muon":
        raise ParamGroupError(f"{where}: optimizer=muon needs optimizer.name = \"Muon\" (got {optimizer_name!r})")
    if optimizer_name == "Adam" and rule.weight_decay:
        raise ParamGroupError(f"{where}: optimizer.name = \"Adam\" applies no weight decay; "
                              "use optimizer.name = \"AdamW\" or drop weight_decay")


def clean_name(name: str) -> str:
    """A parameter name without wrapper components: ``layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def first_match(name: str, rules: list[Rule]) -> int | None:
    """Index of the first rule whose pattern matches ``name``, or None (the default)."""
    for index, rule in enumerate(rules):
        if fnmatch.fnmatchcase(name, rule.pattern):
            return index
    return None


def default_algorithm(name: str, ndim: int, optimizer_name: str) -> str:
    """``muon`` for hidden matrices under ``optimizer.name = "Muon"`` (module docstring), else ``adamw``."""
    if optimizer_name != "Muon" or ndim not in (2, 3):
        return "adamw"
    return "adamw" if any(fnmatch.fnmatchcase(name, p) for p in ADAMW_MATRICES) else "muon"


def group_key(name: str, ndim: int, rules: list[Rule], optimizer_name: str) -> tuple[int | None, str, str]:
    """(rule index or None, algorithm, decay kind) of one parameter; decay kind is ``set`` (the rule's
    weight_decay), ``decay`` (ndim >= 2) or ``no_decay``.

    Raises:
        ParamGroupError: a rule's ``optimizer=muon`` takes a parameter that is not a 2-D matrix or a
            3-D ``[experts, rows, cols]`` stack (Muon orthogonalises matrices: engine/train/muon.py).
    """
    index = first_match(name, rules)
    rule = rules[index] if index is not None else None
    algorithm = (rule.optimizer if rule and rule.optimizer else default_algorithm(name, ndim, optimizer_name))
    if rule is not None and algorithm == "muon" and ndim not in (2, 3):
        raise ParamGroupError(f"optimizer.param_groups rule {rule.text!r} gives optimizer=muon to {name}, a {ndim}-D "
                              "parameter; Muon takes 2-D matrices and 3-D expert weights: narrow the pattern")
    if rule is not None and rule.weight_decay is not None:
        return index, algorithm, "set"
    return index, algorithm, "decay" if ndim >= 2 else "no_decay"


def group_keys(rules: list[Rule], optimizer_name: str) -> list[tuple[int | None, str, str]]:
    """Every group key a run has, in order (rules first, then the default), whether or not this rank
    holds parameters for it, so the optimizer's group layout does not depend on the pipeline stage."""
    keys = []
    for index, rule in [*enumerate(rules), (None, None)]:
        algorithms = [rule.optimizer] if rule and rule.optimizer else (
            ["muon", "adamw"] if optimizer_name == "Muon" else ["adamw"])
        for algorithm in algorithms:
            if rule is not None and rule.weight_decay is not None:
                keys.append((index, algorithm, "set"))
            else:
                keys.extend((index, algorithm, kind) for kind in (("decay",) if algorithm == "muon"
                                                                  else ("decay", "no_decay")))
    return keys


def group_name(key: tuple[int | None, str, str]) -> str:
    """``decay`` / ``no_decay`` / ``muon`` for the default groups (the names AdamW runs always had),
    ``rule<i>.<algorithm>[.<decay kind>]`` for a rule's."""
    index, algorithm, kind = key
    if index is None:
        return "muon" if algorithm == "muon" else kind
    return f"rule{index}.{algorithm}" + ("" if kind == "set" else f".{kind}")


def unmatched_rules(names: list[str], rules: list[Rule]) -> list[Rule]:
    """The rules that take no parameter of ``names`` (every parameter of the whole model)."""
    taken = {first_match(name, rules) for name in names}
    return [rule for index, rule in enumerate(rules) if index not in taken]


def refuse_unmatched(names: list[str], rules: list[Rule]) -> None:
    """Raise ParamGroupError (one line) for the first rule that takes no parameter of the whole model."""
    for rule in unmatched_rules(names, rules):
        sample = ", ".join(names[:3])
        raise ParamGroupError(f"optimizer.param_groups rule {rule.text!r} matches no parameter (an earlier rule "
                              f"may take them all); patterns match names such as {sample}")
