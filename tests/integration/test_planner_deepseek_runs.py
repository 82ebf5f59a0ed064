"""engine/planner's activation peak of the DeepSeek-V3 family (MLA's latents, its math-path attention
on the CPU, the MoE blocks' routed copies; models/deepseek_v3/planning.py) against one-process CPU
runs of its debug flavors: the planner's ``activation_bytes`` within 10 % of the peak of MemTracker's
ACT + TEMP + OTH in the second step (tests/planner_runs.py), without AC, with full AC, with the
per-op policy, and the query latent left out (``debugmodel_noqlora``); and on both ranks of tp 2
with sequence parallel (MLA's heads split, its latents replicated); with two multi-token-prediction
depths (``debugmodel_mtp``)."""

from __future__ import annotations

import pytest

from tests.planner_runs import measured_layouts
from tests.training_utils import base_args


ACTIVATION_TOLERANCE = 0.10
DEEPSEEK = {"model.name": "deepseek_v3", "model.flavor": "debugmodel"}
MTP = {**DEEPSEEK, "model.flavor": "debugmodel_mtp", "loss.mtp_weight": "0.3"}
LAYOUTS = {  # name: (world_size, overrides)
    "ds_ac_none": (1, DEEPSEEK),
    "ds_noqlora_ac_none": (1, {**DEEPSEEK, "model.flavor": "debugmodel_noqlora"}),
    "ds_ac_full": (1, {**DEEPSEEK, "activation_checkpoint.mode": "full"}),
    "ds_ac_op": (1, {**DEEPSEEK, "activation_checkpoint.mode": "selective"}),
    # two MTP depths: their blocks (outside AC), inputs and losses on top, fused and unfused
    "ds_mtp_ac_none": (1, {**MTP}),
    "ds_mtp_ac_full": (1, {**MTP, "activation_checkpoint.mode": "full"}),
    "ds_mtp_unfused_loss": (1, {**MTP, "loss.chunk_tokens": 0}),
    "ds_tp2_sp": (2, {**DEEPSEEK, "parallelism.dp_shard": 1, "parallelism.tp": 2, "training.local_batch_size": 4}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return measured_layouts(LAYOUTS, str(tmp_path_factory.mktemp("planner_deepseek_runs")))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deepseek_v3_activations_within_10_percent_of_measured(name, runs):
    from engine.config import load_config
    from engine.planner.layout import Layout
    from engine.planner.memory import activation_bytes

    world_size, overrides = LAYOUTS[name]
    cfg = load_config(base_args("/tmp/unused", {"training.steps": 3, **overrides}))
    cfg.validate()
    predicted = activation_bytes(Layout.from_config(cfg, world_size, "cpu"))
    for m in runs(name):
        measured = m["activations"]
        assert abs(predicted - measured) <= ACTIVATION_TOLERANCE * measured, (m["rank"], predicted, measured)
