"""Exact resume: a 10-step run equals the same command stopped after step 5 and started again.

For every layout the repo has, loss and the whole step-10 checkpoint (weights, optimizer moments, LR
schedule, data position, RNG) are compared bitwise (fp32) with an uninterrupted run of the same
layout. The data is a tiny corpus that re-loops every 3.5 steps, so resumes cross epoch boundaries.
How the run stops: one process stops through ``train(steps=5)``; FSDP stops on SIGTERM sent to one
rank only (every rank must agree, save step-5 and return); the other layouts resume from the
uninterrupted run's own step-5 (its first five steps *are* the stopped run: saving does not perturb
training, which the first two cases check).
"""

from __future__ import annotations

import os

import pytest

from engine.trainer import Trainer  # noqa: F401 - imported once here, so forked workers start warm
from parallelisms import parallel_dims
from tests.checkpoint_utils import (
    STEPS, STOP, assert_bitwise_equal, ckpt_args, copy_checkpoint, read_checkpoint, train_run,
    write_tiny_corpus,
)
from tests.dist_utils import run_distributed

TP_BUILT = "tp" not in parallel_dims._NOT_SUPPORTED_YET
PP_BUILT = "pp" not in parallel_dims._NOT_SUPPORTED_YET

LAYOUTS = {
    # name: (world size, overrides, how the first run stops)
    "single": (1, {"training.local_batch_size": 8}, "steps"),
    "fsdp2_accum2": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 2}, "sigterm"),
    "ddp2": (2, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4}, "copy"),
    "hsdp2x2": (4, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 2},
                "copy"),
    "tp2": (2, {"parallelism.tp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 8}, "copy"),
    "pp2": (2, {"parallelism.pp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 8,
                "parallelism.pp_microbatch_size": 4}, "copy"),
}
BUILT = {"tp2": TP_BUILT, "pp2": PP_BUILT}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_tiny_corpus(str(tmp_path_factory.mktemp("corpus")))


def _run(world_size: int, argv: list[str], **kwargs) -> list[dict]:
    return run_distributed(train_run, world_size, argv, kwargs.get("steps"), kwargs.get("signal_at"),
                           torchrun_env=world_size > 1)


@pytest.fixture(scope="module")
def single_reference(corpus, tmp_path_factory) -> tuple[str, dict]:
    """The uninterrupted single-process run: (run folder, result); checkpoints at steps 5 and 10."""
    folder = str(tmp_path_factory.mktemp("reference"))
    (result,) = _run(1, ckpt_args(folder, corpus))
    assert sorted(result["losses"]) == list(range(1, STEPS + 1)) and result["stopped_by"] is None
    return folder, result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exact_resume(layout, corpus, single_reference, tmp_path):
    world, overrides, stop = LAYOUTS[layout]
    if not BUILT.get(layout, True):
        pytest.skip(f"{layout}: that parallelism is not built yet")
    uninterrupted = str(tmp_path / "uninterrupted")
    stopped = str(tmp_path / "stopped")
    if layout == "single":
        uninterrupted, full = single_reference
    else:
        # The FSDP reference saves asynchronously: its step-5 was written while steps 6.. ran, and
        # must equal the synchronous save of the stopped run below.
        extra = {"checkpoint.async_mode": "async"} if stop == "sigterm" else {}
        full = _run(world, ckpt_args(uninterrupted, corpus, {**overrides, **extra}))[0]
    argv = ckpt_args(stopped, corpus, overrides)
    if stop == "steps":
        first = _run(world, argv, steps=STOP)
    elif stop == "sigterm":
        sigterm_argv = ckpt_args(stopped, corpus, {**overrides, "checkpoint.interval": 100})
        first = _run(world, sigterm_argv, signal_at=(world - 1, STOP))
        assert [r["stopped_by"] for r in first] == ["SIGTERM"] * world, "not every rank stopped"
    else:
        copy_checkpoint(uninterrupted, stopped, STOP)
        first = None
    if first is not None:
        assert sorted(first[0]["losses"]) == list(range(1, STOP + 1))
        assert first[0]["losses"] == {s: full["losses"][s] for s in range(1, STOP + 1)}
        assert sorted(os.listdir(os.path.join(stopped, "checkpoint"))) == [f"step-{STOP}"]
        if stop == "sigterm":  # the async save of the reference equals the synchronous one
            assert_bitwise_equal(read_checkpoint(os.path.join(stopped, "checkpoint", f"step-{STOP}"), str(tmp_path / "a.pt")),
                                 read_checkpoint(os.path.join(uninterrupted, "checkpoint", f"step-{STOP}"),
                                                 str(tmp_path / "b.pt")), "step-5, async vs sync")

    resumed = _run(world, argv)
    for result in resumed:
        assert result["start_step"] == STOP and result["stopped_by"] is None
        assert result["losses"] == {s: full["losses"][s] for s in range(STOP + 1, STEPS + 1)}, layout
    assert resumed[0]["tokens_seen"] == full["tokens_seen"]
    got = read_checkpoint(os.path.join(stopped, "checkpoint", f"step-{STEPS}"), str(tmp_path / "got.pt"))
    want = read_checkpoint(os.path.join(uninterrupted, "checkpoint", f"step-{STEPS}"), str(tmp_path / "want.pt"))
    assert any(key.startswith("optimizer.state.") for key in want)
    assert_bitwise_equal(got, want, f"{layout}: step-10 checkpoint, resumed vs uninterrupted")
