"""Every recipe feature on every model and loss path against an oracle of its own (issue #48).

The parity tests hold every layout to one process; a feature wrong the same way everywhere passes
them (the z-loss dropped under multi-token prediction did). Here each (feature, path) pair of TABLE
is checked against something other than the product's own code for it, one process, one step, the
smallest flavor; a pair a path cannot take is refused by the pre-flight in one line, and the test
says so. A model path is a family of the registry, or ``<family>+mtp`` where a flavor has
multi-token-prediction blocks; a loss path is a runner (whole model, or the pipeline's stages run
here in stage order) times the loss ``loss.chunk_tokens`` picks (tests/recipe_oracle_checks.py).
A family, MTP flavor or runner that TABLE and LOSS_PATHS do not list fails
``test_every_feature_is_listed_on_every_path`` with the missing pairs named.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch

import pytest
import torch
from torch import nn

from engine.config import load_config
from engine.config.param_groups import clean_name
from engine.train.optimizer import build_optimizer
from tests.recipe_oracle_checks import (
    MTP_WEIGHT, RUNNER_PATHS, Builds, assert_gradients_close, config, float8_linears, loss_paths,
    model_paths, oracle_gradients, oracle_objective, packed_batch, param_group_rules, random_batch, run_path,
    seeded_gradients,
)
from tests.integration.test_muon import _oracle_step


@dataclasses.dataclass(frozen=True)
class Refused:
    """A pair the pre-flight refuses: its one line contains ``words`` (and a ``Fix:``)."""

    words: str


# feature -> (setting that turns it on, value the refusals are tried with)
FEATURES = {"z_loss": ("loss.z_loss_weight", "0.01"), "mtp": ("loss.mtp_weight", "0.3"),
            "param_groups": ("optimizer.param_groups", "layers.* lr_mult=2"),
            "document_mask": ("document_mask.enable", "true"), "float8": ("float8.enable", "true"),
            "muon": ("optimizer.name", "Muon")}
# The oracles (tests/recipe_oracle_checks.py): value, gradients and what the run logs, fp64 unless said.
Z = "PaLM's z-loss from the logits: CE + w·Σ lse(main-head logits)² over the label tokens; logged sum"
MTP = "arXiv 2412.19437 eq. 25 by slicing (test_deepseek_v3_mtp._reference): main + λ·mean of depths; depth sums"
NO_MTP = Refused("loss.mtp_weight = 0.3 but model")  # engine/setup/preflight.py _check_mtp_weight
DOCS = "packed window = Σ of its documents run alone (F.cross_entropy of their logits; MTP depths by slicing)"
F8 = "torchao's convert_to_float8_training by hand (tensorwise, fp32): the same Float8Linear set; != high precision"
MUON = "torch.optim.Muon (hidden matrices, each expert's slice) + torch.optim.AdamW (the rest), one step bitwise"
GROUPS = "torch.optim.AdamW, a group per parameter by the first fnmatch rule (lr_mult × lr, weight decay), bitwise"
TABLE = {
    "z_loss": {"llama": Z, "moe": Z, "qwen3": Z, "qwen3_moe": Z, "deepseek_v3": Z, "deepseek_v3+mtp": Z},
    "mtp": {"llama": NO_MTP, "moe": NO_MTP, "qwen3": NO_MTP, "qwen3_moe": NO_MTP, "deepseek_v3": NO_MTP,
            "deepseek_v3+mtp": MTP},
    "param_groups": {"llama": GROUPS, "moe": GROUPS, "qwen3": GROUPS, "qwen3_moe": GROUPS, "deepseek_v3": GROUPS,
                     "deepseek_v3+mtp": GROUPS},
    "document_mask": {"llama": DOCS, "moe": DOCS, "qwen3": DOCS, "qwen3_moe": DOCS, "deepseek_v3": DOCS,
                      "deepseek_v3+mtp": DOCS},
    "float8": {"llama": F8, "moe": F8, "qwen3": F8, "qwen3_moe": F8, "deepseek_v3": F8, "deepseek_v3+mtp": F8},
    "muon": {"llama": MUON, "moe": MUON, "qwen3": MUON, "qwen3_moe": MUON, "deepseek_v3": MUON,
             "deepseek_v3+mtp": MUON},
}
ALL = {"unfused": None, "fused": None, "pp_last_stage/unfused": None, "pp_last_stage/fused": None}
# An optimizer's inputs are the parameters and their gradients: the loss kind changes neither set
# (tests/integration/test_fused_loss.py holds the gradients equal), the pipeline's last stage holds its own parameters.
SAME = "as unfused: the loss kind reaches no optimizer input"
OPTIMIZER = {"unfused": None, "fused": SAME, "pp_last_stage/unfused": None, "pp_last_stage/fused": SAME}
# feature -> loss path -> None (the oracle runs there) or why the path is not one of its own
LOSS_PATHS = {"z_loss": ALL, "mtp": ALL, "document_mask": ALL, "float8": ALL, "param_groups": OPTIMIZER,
              "muon": OPTIMIZER}

PATHS = model_paths()
CASES = [(f, m, loss) for f, row in TABLE.items() for m, oracle in row.items() if not isinstance(oracle, Refused)
         for loss, why in LOSS_PATHS[f].items() if why is None]
REFUSALS = [(f, m) for f, row in TABLE.items() for m, oracle in row.items() if isinstance(oracle, Refused)]
Z_WEIGHT = 1e-2


def missing_pairs(paths: list[str], losses: list[str]) -> list[str]:
    """The (feature, path) pairs TABLE / LOSS_PATHS do not list, and the entries of no path."""
    missing = [f"{f} x {p}" for f in FEATURES for p in paths if p not in TABLE.get(f, {})]
    missing += [f"{f} x {loss}" for f in FEATURES for loss in losses if loss not in LOSS_PATHS.get(f, {})]
    stale = [f"{f} x {p} (no such path)" for f, row in TABLE.items() for p in row if p not in paths]
    return missing + stale + [f"{f} (not a feature)" for f in TABLE if f not in FEATURES]


def _runner_names() -> list[str]:
    from engine.train.runner import _Runner

    return sorted(cls.__name__ for cls in _Runner.__subclasses__())


def test_every_feature_is_listed_on_every_path(monkeypatch):
    runners = _runner_names()
    assert not [r for r in runners if r not in RUNNER_PATHS], f"a runner with no loss path: {runners}"
    assert not missing_pairs(sorted(PATHS), loss_paths(runners)), missing_pairs(sorted(PATHS), loss_paths(runners))
    for setting, value in FEATURES.values():  # a renamed setting fails here
        load_config([f"--{setting}", value])
    # a new family (here llama's spec again under another name) is found and named
    import models.registry as registry

    monkeypatch.setitem(registry._REGISTRY, "llama_copy", dataclasses.replace(registry.get_model_spec("llama"),
                                                                             name="llama_copy"))
    assert "z_loss x llama_copy" in missing_pairs(sorted(model_paths()), loss_paths(runners))


@pytest.mark.parametrize("feature, model_path", REFUSALS, ids=[f"{f}-{m}" for f, m in REFUSALS])
def test_a_pair_the_path_cannot_take_is_refused_in_one_line(feature, model_path):
    setting, value = FEATURES[feature]
    with pytest.raises(ValueError) as error:
        config(PATHS[model_path], overrides=[f"--{setting}", value])
    message = str(error.value)
    assert "\n" not in message and TABLE[feature][model_path].words in message and "Fix:" in message, message


@pytest.fixture(scope="module")
def builds():
    return Builds()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the float64 reference mode runs
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _fp64(builds, path, loss_path):
    """(the path's parts, the whole model), float64."""
    pp = loss_path.startswith(RUNNER_PATHS["PipelineRunner"])
    return builds.parts(path, pp=pp, dtype=torch.float64), builds.parts(path, pp=False, dtype=torch.float64)[0]


def _check_objective(builds, path, loss_path, *, z_weight=0.0, documents=False):
    """The path's loss and gradients against :func:`oracle_objective` on the whole model, fp64."""
    parts, whole = _fp64(builds, path, loss_path)
    tokens, labels = packed_batch() if documents else random_batch(whole.model_args.vocab_size)
    for part in parts:
        if getattr(part, "mtp", None) is not None:
            part.mtp_stats.zero_()
    with _default_dtype(torch.float64):
        got = run_path(parts, loss_path, tokens, labels, z_weight=z_weight, documents=documents)
        key = ("oracle", path.name, z_weight, documents)  # the same for every loss path
        if key not in builds.cache:
            objective, z_sum = oracle_objective(whole, tokens, labels, mtp_weight=MTP_WEIGHT * path.mtp,
                                                z_weight=z_weight, documents=documents)
            mean = objective / (labels != -100).sum()
            builds.cache[key] = (mean.detach(), z_sum.detach(), oracle_gradients(whole, mean))
    want, z_want, want_grads = builds.cache[key]
    where = f"{path.name}, {loss_path}"
    logged = torch.as_tensor(got.z_logged, dtype=torch.float64)
    assert torch.allclose(logged, z_want, rtol=1e-10, atol=0), f"{where}: z-loss logged {logged:.6g} vs {z_want:.6g}"
    assert torch.allclose(got.loss, want, rtol=1e-10, atol=0), f"{where}: loss {got.loss:.10g}, oracle {want:.10g}"
    assert_gradients_close(got.grads, want_grads, 1e-8, where)
    return parts, whole, tokens, labels


def check_z_loss(builds, path, loss_path):
    _check_objective(builds, path, loss_path, z_weight=Z_WEIGHT)


def check_mtp(builds, path, loss_path):
    from tests.unit.test_deepseek_v3_mtp import _reference

    parts, whole, tokens, labels = _check_objective(builds, path, loss_path)
    stats = sum(part.mtp_stats for part in parts if getattr(part, "mtp", None) is not None)
    with _default_dtype(torch.float64), torch.no_grad():
        _, sums, counts = _reference(whole, tokens, labels)
    assert stats[1].tolist() == counts, f"{loss_path}: MTP targets per depth {stats[1].tolist()}, oracle {counts}"
    assert torch.allclose(stats[0], torch.stack(sums), rtol=1e-10, atol=0), f"{loss_path}: depth sums {stats[0]}"


def check_document_mask(builds, path, loss_path):
    _check_objective(builds, path, loss_path, documents=True)


def check_float8(builds, path, loss_path):
    pytest.importorskip("torchao", reason="torchao is not installed (the float8 extra)")
    pp, kind = loss_path.startswith(RUNNER_PATHS["PipelineRunner"]), loss_path.rsplit("/", 1)[-1]
    parts = builds.parts(path, pp=pp, dtype=torch.float32, float8=True)
    plain = builds.parts(path, pp=False, dtype=torch.float32)[0]
    reference = builds.float8_reference(path)
    assert float8_linears(parts) == float8_linears([reference]) != set()
    tokens, labels = random_batch(plain.model_args.vocab_size)
    got = run_path(parts, loss_path, tokens, labels)
    key = ("float8", path.name, kind)  # the same for the whole model and the pipeline's stages
    if key not in builds.cache:
        builds.cache[key] = run_path([reference], kind, tokens, labels), run_path([plain], kind, tokens, labels)
    want, high = builds.cache[key]
    assert abs(got.loss - want.loss) <= 1e-6 * want.loss, f"{loss_path}: loss {got.loss:.8g}, torchao's {want.loss:.8g}"
    assert_gradients_close(got.grads, want.grads, 1e-5, f"{path.name} {loss_path}")
    # float8 moves the gradients by 0.6% (DeepSeek-V3) to 5.5% (with MTP) of their norm here; the loss
    # at initialization far less (1e-6 to 2e-5): a path that dropped float8 would be off by that
    off = sum((high.grads[n] - g).square().sum() for n, g in want.grads.items()).sqrt()
    assert off > 1e-3 * sum(g.square().sum() for g in want.grads.values()).sqrt(), "float8 changed no gradient"


def _optimizer_case(builds, path, loss_path, overrides):
    """(config, the part trained (the whole model or the last stage), its twin for the oracle)."""
    pp = loss_path.startswith(RUNNER_PATHS["PipelineRunner"])
    cfg, _ = config(path, pp=pp, overrides=overrides)
    part = copy.deepcopy(builds.parts(path, pp=pp, dtype=torch.float32)[-1])
    return cfg, pp, part, copy.deepcopy(part)


def _step_and_compare(optimizer, part, reference, oracle_step) -> None:
    grads = seeded_gradients(part)
    for name, param in part.named_parameters():
        param.grad = grads[name].clone()
    optimizer.step()
    oracle_step(grads)
    for (name, got), want in zip(part.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), (name, (got - want).abs().max().item())


def check_muon(builds, path, loss_path):
    cfg, pp, part, reference = _optimizer_case(builds, path, loss_path, ["--optimizer.name", "Muon"])
    o = cfg.optimizer
    optimizer = build_optimizer([part], o, whole_model=not pp)
    named = list(reference.named_parameters())
    # Muon's authors' split: the hidden weight matrices; the embedding, the output head and the router on AdamW
    on_adamw = ("tok_embeddings.weight", "output.weight")
    hidden = [p for n, p in named if p.ndim == 2 and clean_name(n) not in on_adamw and ".router." not in n]
    experts = {n: [nn.Parameter(p.detach()[i].clone()) for i in range(p.shape[0])] for n, p in named if p.ndim == 3}
    assert hidden, f"{path.name}: no matrix for Muon"
    muon = torch.optim.Muon(hidden + [s for slices in experts.values() for s in slices], lr=o.muon_lr,
                            weight_decay=o.weight_decay, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                            adjust_lr_fn=o.muon_adjust_lr)
    matrices = [p for _, p in named if p.ndim == 2 and not any(p is h for h in hidden)]
    adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": o.weight_decay},
                               {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
                              lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False, fused=False)
    _step_and_compare(optimizer, part, reference, lambda grads: _oracle_step(reference, grads, muon, adamw, experts))


def check_param_groups(builds, path, loss_path):
    whole = builds.parts(path, pp=False, dtype=torch.float32)[0]
    rules = param_group_rules([clean_name(n) for n, _ in whole.named_parameters()])
    assert len(rules) >= 3, rules
    cfg, pp, part, reference = _optimizer_case(builds, path, loss_path, ["--optimizer.param_groups", ",".join(rules)])
    o = cfg.optimizer
    optimizer = build_optimizer([part], o, whole_model=not pp)
    groups = []
    for name, param in reference.named_parameters():
        words = next((r.split() for r in rules if fnmatch.fnmatchcase(clean_name(name), r.split()[0])), [name])
        fields = dict(w.split("=") for w in words[1:])
        decay = float(fields.get("weight_decay", o.weight_decay if param.ndim >= 2 else 0.0))
        groups.append({"params": [param], "lr": o.lr * float(fields.get("lr_mult", 1.0)), "weight_decay": decay})
    adamw = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False, fused=False)

    def oracle_step(grads):
        for name, param in reference.named_parameters():
            param.grad = grads[name].clone()
        adamw.step()

    _step_and_compare(optimizer, part, reference, oracle_step)


CHECKS = {"z_loss": check_z_loss, "mtp": check_mtp, "document_mask": check_document_mask, "float8": check_float8,
          "muon": check_muon, "param_groups": check_param_groups}


@pytest.mark.parametrize("feature, model_path, loss_path", CASES, ids=["-".join(case) for case in CASES])
def test_feature_on_path_equals_its_oracle(builds, feature, model_path, loss_path):
    CHECKS[feature](builds, PATHS[model_path], loss_path)
