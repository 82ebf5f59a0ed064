"""Pipeline parallel: stage planning and its errors (pure), and training parity against one process
for the schedules, with data parallel, with gradient accumulation and with uneven splits (gloo).
Validation through the pipeline and the timed bubble are in tests/integration/test_pipeline_timed.py."""

from __future__ import annotations

import types

import pytest

from parallelisms.pipeline import (
    PipelineConfigError,
    plan_pipeline,
    split_layers_at,
    split_layers_evenly,
    stage_ids_for_rank,
)
from engine.testing.processes import run_distributed
from tests.training_utils import LayoutRuns, assert_parity, base_args, train_and_record



def pp_cfg(**changes):
    settings = dict(
        pp=2, pp_schedule="1F1B", pp_microbatch_size=1, pp_stages_per_rank=-1, pp_layers_per_stage=-1,
        pp_split_points=[], pp_input_weight=1.0, pp_output_weight=1.0,
    )
    settings.update(changes)
    return types.SimpleNamespace(**settings)


# ---------------------------------------------------------------------------- planning (one process)
def test_even_split_counts_embedding_and_head_as_layers():
    assert split_layers_evenly(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_layers_evenly(6, 4) == [[0], [1, 2], [3, 4], [5]]
    # A heavy output head (e.g. a large vocabulary) moves layers to the first stage.
    assert split_layers_evenly(6, 2, output_weight=3.0) == [[0, 1, 2, 3], [4, 5]]
    assert split_layers_evenly(6, 2, input_weight=0.0, output_weight=0.0) == [[0, 1, 2], [3, 4, 5]]


def test_explicit_split_points():
    assert split_layers_at(6, ["layers.2"]) == [[0, 1], [2, 3, 4, 5]]
    assert split_layers_at(6, ["layers.1", "layers.3", "layers.5"]) == [[0], [1, 2], [3, 4], [5]]


def test_stage_to_rank_mapping():
    assert stage_ids_for_rank(0, 2, 4, v_style=False) == (0, 2)
    assert stage_ids_for_rank(1, 2, 4, v_style=False) == (1, 3)
    assert stage_ids_for_rank(0, 2, 4, v_style=True) == (0, 3)
    assert stage_ids_for_rank(1, 2, 4, v_style=True) == (1, 2)


def test_plan_defaults_per_schedule():
    plan = plan_pipeline(pp_cfg(), n_layers=6, local_batch_size=4, pp_rank=1)
    assert (plan.num_stages, plan.local_stages, plan.n_microbatches) == (2, (1,), 4)
    plan = plan_pipeline(pp_cfg(pp_schedule="interleaved1f1b"), n_layers=6, local_batch_size=4, pp_rank=0)
    assert (plan.schedule_name, plan.num_stages, plan.local_stages) == ("Interleaved1F1B", 4, (0, 2))
    plan = plan_pipeline(pp_cfg(pp_schedule="1F1B", pp_layers_per_stage=3), n_layers=6, local_batch_size=2, pp_rank=0)
    assert plan.stage_layers == ((0, 1, 2), (3, 4, 5))


@pytest.mark.parametrize(
    "changes, local_batch_size, message",
    [
        ({"pp_schedule": "Zigzag"}, 4, "pp_schedule = 'Zigzag' is not a pipeline schedule; use one of GPipe"),
        ({"pp_microbatch_size": 3}, 4, "not divisible by parallelism.pp_microbatch_size = 3"),
        ({"pp_schedule": "1F1B", "pp_microbatch_size": 4}, 4, "1 microbatches .* are fewer than parallelism.pp = 2"),
        ({"pp": 4, "pp_stages_per_rank": 2, "pp_schedule": "Interleaved1F1B"}, 8, "8 pipeline stages but the model has 6 layers"),
        ({"pp_split_points": ["layers.3", "layers.3", "layers.5"], "pp_schedule": "Interleaved1F1B"}, 4, "empty stage"),
        ({"pp_split_points": ["layer.3"]}, 4, "names no module"),
        ({"pp_split_points": ["layers.9"]}, 4, "names no module"),
        ({"pp_schedule": "GPipe", "pp_stages_per_rank": 2}, 4, "runs one stage per rank but the split gives 2"),
        ({"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 1}, 4, "needs several stages per rank"),
        ({"pp_split_points": ["layers.2", "layers.4"]}, 4, "cannot be spread evenly over parallelism.pp = 2"),
        ({"pp_layers_per_stage": 4}, 4, "does not divide the model's 6 layers"),
    ],
)
def test_plan_errors(changes, local_batch_size, message):
    with pytest.raises(PipelineConfigError, match=message):
        plan_pipeline(pp_cfg(**changes), n_layers=6, local_batch_size=local_batch_size, pp_rank=0)


def test_gpipe_allows_fewer_microbatches_than_stages_with_a_warning(caplog):
    plan = plan_pipeline(pp_cfg(pp_schedule="GPipe", pp_microbatch_size=8), n_layers=6, local_batch_size=8, pp_rank=0)
    assert plan.n_microbatches == 1
    assert "GPipe idles 50% of each step" in caplog.text


# ---------------------------------------------------------------------------- parity (gloo)
LAYOUTS = {
    # name: (world_size, overrides); every layout trains on the same global batch of 8.
    "gpipe": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "GPipe"}),
    "1f1b": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "1F1B"}),
    "interleaved_1f1b_2_stages_per_rank": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "Interleaved1F1B"}),
    "zbv_zero_bubble": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "ZBVZeroBubble"}),
    "looped_bfs": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "LoopedBFS"}),
    "interleaved_zero_bubble": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "InterleavedZeroBubble"}),
    "dualpipev": (2, {"parallelism.pp": 2, "parallelism.pp_schedule": "DualPipeV"}),
    "1f1b_x_ddp2": (4, {"parallelism.pp": 2, "parallelism.dp_replicate": 2, "parallelism.dp_shard": 1,
                        "training.local_batch_size": 4, "parallelism.pp_microbatch_size": 2}),
    "1f1b_accum2": (2, {"parallelism.pp": 2, "training.local_batch_size": 4}),
    "1f1b_uneven_split": (2, {"parallelism.pp": 2, "parallelism.pp_split_points": "layers.2"}),
    "3d_1f1b_x_fsdp2_x_tp2": (
        8,
        {"parallelism.pp": 2, "parallelism.dp_shard": 2, "parallelism.tp": 2, "training.local_batch_size": 4,
         "parallelism.pp_microbatch_size": 2},
    ),
    # with per-block compile (aot_eager: the graph capture without code generation)
    "1f1b_x_fsdp2_compile": (
        4,
        {"parallelism.pp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4, "parallelism.pp_microbatch_size": 2,
         "compile.enable": "true", "compile.backend": "aot_eager"},
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(LAYOUTS, str(tmp_path_factory.mktemp("pp")))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_parity_with_one_process(layout, reference, runs):
    for history in runs.history(layout):  # the true loss on every rank, not only on the last stage
        assert_parity(history, reference)


def test_tied_embeddings_refused_with_pp(tmp_path):
    argv = base_args(str(tmp_path), {"parallelism.pp": 2, "model.tie_embeddings": "true"})
    with pytest.raises(RuntimeError, match="model.tie_embeddings = true cannot be split across pipeline stages"):
        run_distributed(train_and_record, 2, argv)
