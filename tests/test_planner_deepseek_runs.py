"""engine/planner's activation peak of the DeepSeek-V3 family (MLA's latents, its math-path attention
on the CPU, the MoE blocks' routed copies; models/deepseek_v3/planning.py) against one-process CPU
runs of its debug flavors: the planner's ``activation_bytes`` within 10 % of the peak of MemTracker's
ACT + TEMP + OTH in the second step (tests/planner_runs.py), without AC, with full AC, with the
per-op policy, and the query latent left out (``debugmodel_noqlora``)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.planner_runs import measure_layouts
from tests.training_utils import base_args

pytestmark = pytest.mark.slow  # training runs in a forked process

ACTIVATION_TOLERANCE = 0.10
DEEPSEEK = {"model.name": "deepseek_v3", "model.flavor": "debugmodel"}
LAYOUTS = {
    "ds_ac_none": DEEPSEEK,
    "ds_noqlora_ac_none": {**DEEPSEEK, "model.flavor": "debugmodel_noqlora"},
    "ds_ac_full": {**DEEPSEEK, "activation_checkpoint.mode": "full"},
    "ds_ac_op": {**DEEPSEEK, "activation_checkpoint.mode": "selective"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("planner_deepseek_runs"))
    (results,) = run_distributed(measure_layouts, 1, folder, LAYOUTS, timeout=240.0, torchrun_env=False)
    for name, result in results.items():
        if isinstance(result, str):
            raise AssertionError(f"layout {name}:\n{result}")
    return results


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deepseek_v3_activations_within_10_percent_of_measured(name, runs):
    from engine.config import load_config
    from engine.planner.layout import Layout
    from engine.planner.memory import activation_bytes

    cfg = load_config(base_args("/tmp/unused", {"training.steps": 3, **LAYOUTS[name]}))
    cfg.validate()
    predicted = activation_bytes(Layout.from_config(cfg, 1, "cpu"))
    measured = runs[name]["activations"]
    assert abs(predicted - measured) <= ACTIVATION_TOLERANCE * measured, (predicted, measured)
