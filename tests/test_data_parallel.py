"""FSDP2, HSDP and DDP train the same model as one process: loss and grad-norm parity (gloo, CPU).

Every layout sees the same global batch of 8 sequences per step, split differently over ranks and
accumulation microbatches; the reference is a plain single process (no process group).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import assert_parity, base_args, train_and_record

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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parity_with_one_process(layout, reference, tmp_path):
    world_size, overrides = LAYOUTS[layout]
    argv = base_args(str(tmp_path), overrides)
    results = run_distributed(train_and_record, world_size, argv, torchrun_env=world_size > 1)
    # Every rank reports the same globally reduced loss and grad norm.
    for history in results:
        assert_parity(history, reference)
