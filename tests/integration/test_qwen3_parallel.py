"""Qwen3 and Qwen3-MoE under every parallelism: loss, grad-norm, validation and routing-metric parity
against one process (gloo, CPU), with clipping engaged on both sides of the threshold.

What these layouts guard beyond the LLaMA / MoE ones: the QK-norm weights [head_dim] under tensor
parallel (replicated, their gradient summed over the heads of every tp rank, with and without
sequence parallel), a head width that is not dim / n_heads through TP, CP (ring attention) and PP,
and Qwen3-MoE's routing under expert parallel. All layouts of one world size train in the same forked
ranks, one after another (:class:`tests.training_utils.LayoutRuns`); the context-parallel ones also
with torch.compile (``<layout>_compiled``).
"""

from __future__ import annotations

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import LayoutRuns, assert_parity, base_args, clipping_sides, train_and_record, with_compiled_twins


DENSE = {"model.name": "qwen3", "model.flavor": "debugmodel_tiny"}
MOE = {"model.name": "qwen3_moe", "model.flavor": "debugmodel_tiny"}

# name: (world_size, overrides); every layout trains on the same global batch of 8 sequences.
LAYOUTS = with_compiled_twins({
    "qwen3_fsdp2": (2, {**DENSE, "parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    # Sequence and loss parallel (the defaults): QK-norm runs on each rank's 4 of 8 query heads.
    "qwen3_tp2": (2, {**DENSE, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "qwen3_tp2_no_sequence_parallel": (
        2, {**DENSE, "parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.sequence_parallel": "false"}),
    "qwen3_pp2": (2, {**DENSE, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    "qwen3_cp2": (2, {**DENSE, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "qwen3_ddp2": (2, {**DENSE, "parallelism.dp_replicate": 2, "parallelism.dp_shard": 1,
                       "training.local_batch_size": 4}),
    # FSDP over tp: the QK-norm weights, Replicate on tp, are sharded once more over dp_shard.
    "qwen3_fsdp2_x_tp2": (4, {**DENSE, "parallelism.dp_shard": 2, "parallelism.tp": 2,
                              "training.local_batch_size": 4}),
    "qwen3_moe_ep2": (2, {**MOE, "parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 4}),
    "qwen3_moe_tp2": (2, {**MOE, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "qwen3_moe_pp2": (2, {**MOE, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    "qwen3_moe_cp2": (2, {**MOE, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "qwen3_moe_ep2_x_tp2": (4, {**MOE, "parallelism.dp_shard": 2, "parallelism.ep": 2, "parallelism.tp": 2,
                                "training.local_batch_size": 4}),
})


def _references(folder: str) -> dict:
    return {model["model.name"]: train_and_record(base_args(f"{folder}/{model['model.name']}", model))
            for model in (DENSE, MOE)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """{model.name: History} of the 5-step single-process runs (no process group)."""
    (result,) = run_distributed(_references, 1, str(tmp_path_factory.mktemp("qwen3_single")), torchrun_env=False,
                                timeout=600)
    for name, history in result.items():
        above, below = clipping_sides(history)
        assert above >= 1 and below >= 1, f"{name}: max_norm is not between the steps' norms: {list(history)}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(LAYOUTS, str(tmp_path_factory.mktemp("qwen3_layouts")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_parity_with_one_process(layout, references, runs):
    reference = references[LAYOUTS[layout][1]["model.name"]]
    for history in runs.history(layout):  # every rank reports the global loss and grad norm
        assert_parity(history, reference)
