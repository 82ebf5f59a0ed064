"""The contract every registered model family keeps (models/registry.py ``ModelSpec``), checked for
each family and each of its small flavors on the meta device: the planner's parameter list equals
the module's parameters (names, shapes, module order: what the one FLOPs formula,
models/common/shapes.py ``training_flops_per_token``, counts), and the Hugging Face adapter (when
given) covers every weight."""

from __future__ import annotations

import pytest
import torch

import models  # noqa: F401
from models.common.hf import HFConfigError
from models.registry import get_model_spec, list_model_names

SEQ_LEN = 64


def _small_flavors():
    for name in list_model_names():
        spec = get_model_spec(name)
        for flavor, args in spec.flavors.items():
            if args.dim * args.n_layers <= 4096:  # the debug-sized flavors
                yield pytest.param(name, flavor, id=f"{name}-{flavor}")


def _meta_model(spec, args):
    from engine.setup.model_builder import build_meta_model

    return build_meta_model(spec, args)


@pytest.mark.parametrize("name, flavor", list(_small_flavors()))
def test_family_contract(name, flavor):
    spec = get_model_spec(name)
    args = spec.flavors[flavor]
    model = _meta_model(spec, args)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    listed = spec.get("param_shapes")(args)
    assert [(p.name, p.shape) for p in listed] == list(shapes.items())  # same names, shapes, module order
    if spec.expert_routing is not None:
        routing = spec.get("expert_routing")(args)
        # Routed layers by block index; a multi-token-prediction block beside the output head has none.
        assert routing.moe_layers == {p.layer for p in listed if p.expert and p.layer is not None}
    if spec.hf_adapter is not None:
        try:
            rules = spec.get("hf_adapter").weight_rules(args)
        except HFConfigError:
            return  # a flavor without a Hugging Face equivalent (e.g. shared experts)
        assert {r.quadra for r in rules} == set(model.state_dict())


def test_debug_flavors_are_covered():
    assert {p.values[0] for p in _small_flavors()} == set(list_model_names())
    assert torch  # the contract builds real (meta) modules
