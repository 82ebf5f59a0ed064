"""Context parallel trains the same model as one process (gloo, CPU): loss and grad-norm parity, each
layout eager and with torch.compile (``<layout>_compiled``: the ring's custom operator inside compiled
blocks; the all-gather's functional collectives traced into them). The layouts of one world size train
in the same forked ranks, one after another (:class:`tests.training_utils.LayoutRuns`)."""

from __future__ import annotations

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import LayoutRuns, assert_parity, base_args, train_and_record, with_compiled_twins


LAYOUTS = with_compiled_twins({
    # name: (world_size, overrides); the global batch is 8 sequences of 64 tokens in every layout.
    "cp2_ring": (2, {"parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "cp2_allgather_no_load_balance": (
        2,
        {"parallelism.cp": 2, "parallelism.dp_shard": 1, "parallelism.cp_rotate_method": "allgather",
         "parallelism.cp_load_balance": "false"},
    ),
    "cp4_ring": (4, {"parallelism.cp": 4, "parallelism.dp_shard": 1}),
    "cp2_x_fsdp2": (4, {"parallelism.cp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "cp2_x_hsdp": (4, {"parallelism.cp": 2, "parallelism.dp_replicate": 2, "parallelism.dp_shard": 1,
                       "training.local_batch_size": 4}),
    "cp2_x_pp2": (4, {"parallelism.cp": 2, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    "cp2_x_tp2": (4, {"parallelism.cp": 2, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    # The full 4-D mesh, 16 processes (pp × cp × tp without dp is inside it, and each pair of them
    # has its own layout above): the slowest test of the suite.
    "4d_pp2_x_dp_shard2_x_cp2_x_tp2": (
        16,
        {"parallelism.pp": 2, "parallelism.dp_shard": 2, "parallelism.cp": 2, "parallelism.tp": 2,
         "training.local_batch_size": 4, "parallelism.pp_microbatch_size": 2},
    ),
})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(LAYOUTS, str(tmp_path_factory.mktemp("context_parallel")))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_parity_with_one_process(layout, reference, runs):
    for history in runs.history(layout):
        assert_parity(history, reference)


def test_seq_len_not_divisible_fails_at_start_up(tmp_path):
    argv = base_args(str(tmp_path), {"parallelism.cp": 2, "parallelism.dp_shard": 1, "training.seq_len": 66})
    with pytest.raises(RuntimeError, match="training.seq_len = 66 must be divisible by 2·cp·tp = 4"):
        run_distributed(train_and_record, 2, argv)
