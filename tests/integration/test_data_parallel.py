"""FSDP2, HSDP and DDP train the same model as one process: loss and grad-norm parity (gloo, CPU).

Every layout sees the same global batch of 8 sequences per step, split differently over ranks and
accumulation microbatches; the reference is a plain single process (no process group).
"""

from __future__ import annotations

import pytest

from tests.training_utils import LayoutRuns, assert_parity


# The single-process reference is the session fixture `reference` (tests/conftest.py).


LAYOUTS = {
    # name: (world_size, overrides)
    "single_accum4": (1, {"training.local_batch_size": 2}),
    "fsdp2": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "fsdp2_accum2": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 2}),
    "fsdp4": (4, {"parallelism.dp_shard": 4, "training.local_batch_size": 2}),
    "hsdp2x2": (4, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 2}),
    "fsdp2_accum2_sync_last": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 2,
                                   "parallelism.grad_sync_each_microbatch": "false"}),
    "hsdp2x2_accum2_sync_last": (
        4,
        {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 1,
         "parallelism.grad_sync_each_microbatch": "false"},
    ),
    "ddp2": (2, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4}),
    "ddp2_accum2_sync_last": (
        2,
        {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 2,
         "parallelism.grad_sync_each_microbatch": "false"},
    ),
    "ddp2_x_tp2": (4, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1, "parallelism.tp": 2,
                       "training.local_batch_size": 4}),
    "fsdp2_reshard_always": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 4,
                                 "parallelism.fsdp_reshard_after_forward": "always"}),
    # with per-block compile (aot_eager: the graph capture without code generation)
    "fsdp2_reshard_never_compile": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 4,
                                        "parallelism.fsdp_reshard_after_forward": "never",
                                        "compile.enable": "true", "compile.backend": "aot_eager"}),
}


# Streaming data (datasets' IterableDataset, split over the dp ranks by the loader) against one
# streaming process: not against `reference`, whose map-style data is shuffled differently.
STREAMING = {"data.streaming": "true"}
STREAMING_LAYOUTS = {
    "single_streaming": (1, STREAMING),
    "fsdp2_streaming_accum2": (2, {**STREAMING, "parallelism.dp_shard": 2, "training.local_batch_size": 2}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns({**LAYOUTS, **STREAMING_LAYOUTS}, str(tmp_path_factory.mktemp("dp")))


def test_streaming_data_over_ranks_equals_one_process(runs):
    (single,) = runs.history("single_streaming")
    for history in runs.history("fsdp2_streaming_accum2"):
        assert_parity(history, single)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parity_with_one_process(layout, reference, runs):
    # Every rank reports the same globally reduced loss and grad norm.
    for history in runs.history(layout):
        assert_parity(history, reference)
