"""Resume: exactly under the same layout, on another layout, and after a crash in the middle of a save.

Exact resume: a 10-step run equals the same command stopped after step 5 and started again.

For every layout the repo has, loss and the whole step-10 checkpoint (weights, optimizer moments, LR
schedule, data position, RNG) are compared bitwise (fp32) with an uninterrupted run of the same
layout. The data is a tiny corpus that re-loops every 3.5 steps, so resumes cross epoch boundaries.
How the run stops: one process stops through ``train(steps=5)``; FSDP stops on SIGTERM sent to one
rank only (every rank must agree, save step-5 and return); the other layouts resume from the
uninterrupted run's own step-5 (its first five steps *are* the stopped run: saving does not perturb
training, which the first two cases check).

Another layout: step-5 saved by dp_shard=4 continues under dp_shard=2, one process, and tp=2 x
dp_shard=2; the losses match the uninterrupted single-process run to 1e-5 (float summation order
differs between layouts) and the data windows read before and after the resume cover each global
position exactly once.
"""

from __future__ import annotations

import collections
import os

import pytest

from tests.checkpoint_utils import (
    STEPS, STOP, assert_bitwise_equal, assert_losses_close, ckpt_args, copy_checkpoint, read_checkpoint,
    train_run, write_tiny_corpus,
)
from engine.testing.processes import run_distributed



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
    "cp2": (2, {"parallelism.cp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 8}, "copy"),
    # The MoE model with expert parallel: experts sharded over ep, the rest FSDP; its load-balancing
    # expert biases (updated after each optimizer step) are model state too.
    "ep2": (2, {"model.name": "moe", "parallelism.dp_shard": 2, "parallelism.ep": 2,
                "training.local_batch_size": 4}, "copy"),
}


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


# ---------------------------------------------------------------- resume on another layout
SAVE_LAYOUT = (4, {"parallelism.dp_shard": 4, "training.local_batch_size": 2})
TARGETS = {
    "fsdp2": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "single": (1, {"training.local_batch_size": 8}),
    "tp2_fsdp2": (4, {"parallelism.tp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4}),
}


@pytest.fixture(scope="module")
def saved_by_fsdp4(corpus, tmp_path_factory) -> tuple[str, list[dict]]:
    """A dp_shard=4 run of the 10-step command stopped after step 5 (its step-5 checkpoint)."""
    folder = str(tmp_path_factory.mktemp("fsdp4"))
    world, overrides = SAVE_LAYOUT
    return folder, _run(world, ckpt_args(folder, corpus, overrides), steps=STOP)


def _windows_by_stream(results: list[dict]) -> list[int]:
    """Global window positions read, once per data stream (tp/pp peers of a dp rank read the same)."""
    seen, windows = set(), []
    for result in results:
        if result["dp_rank"] not in seen:
            seen.add(result["dp_rank"])
            windows += result["windows"]
    return windows


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_on_another_layout(target, corpus, saved_by_fsdp4, single_reference, tmp_path):
    world, overrides = TARGETS[target]
    saved_run, first = saved_by_fsdp4
    _, reference = single_reference
    before = {s: reference["losses"][s] for s in range(1, STOP + 1)}
    after = {s: reference["losses"][s] for s in range(STOP + 1, STEPS + 1)}
    assert_losses_close(first[0]["losses"], before, rel=1e-5)
    folder = str(tmp_path / target)
    copy_checkpoint(saved_run, folder, STOP)
    resumed = _run(world, ckpt_args(folder, corpus, overrides))
    windows_per_step = 8
    for result in resumed:
        assert (result["start_step"], result["start_position"]) == (STOP, STOP * windows_per_step)
        assert result["end_position"] == STEPS * windows_per_step
    worst = assert_losses_close(resumed[0]["losses"], after, rel=1e-5)
    print(f"{target}: largest relative loss difference after the resume {worst:.2e}")
    read = collections.Counter(_windows_by_stream(first) + _windows_by_stream(resumed))
    assert read == collections.Counter(range(STEPS * windows_per_step)), "a window was repeated or skipped"


# ---------------------------------------------------------------- a crash in the middle of a save
def _crash_in_save(argv: list[str], step: int) -> dict:
    """Train, but die while saving ``step``: after DCP wrote every file, before the save completed."""
    from engine.checkpoint import files as checkpoint_files

    write_marker = checkpoint_files.write_marker

    def crashing_write_marker(path, info):
        if info["step"] == step:
            raise RuntimeError(f"simulated crash while saving step {step}")
        write_marker(path, info)

    checkpoint_files.write_marker = crashing_write_marker
    return train_run(argv)


def test_crash_during_save_resumes_from_the_previous_checkpoint(corpus, single_reference, tmp_path):
    """keep_latest_k = 2 with saves every 2 steps; the save of step 8 dies half-way."""
    folder = str(tmp_path)
    argv = ckpt_args(folder, corpus, {"checkpoint.interval": 2, "checkpoint.keep_latest_k": 2})
    with pytest.raises(RuntimeError, match="simulated crash while saving step 8"):
        run_distributed(_crash_in_save, 1, argv, 8, torchrun_env=False)
    checkpoints = os.path.join(folder, "checkpoint")
    # Older ones were pruned only after a newer one was complete; the broken save stays .tmp.
    assert sorted(os.listdir(checkpoints)) == ["step-4", "step-6", "step-8.tmp"]
    assert os.path.isfile(os.path.join(checkpoints, "step-8.tmp", ".metadata"))

    (resumed,) = _run(1, argv)
    assert resumed["start_step"] == 6
    _, reference = single_reference
    assert resumed["losses"] == {s: reference["losses"][s] for s in range(7, STEPS + 1)}
    assert sorted(os.listdir(checkpoints)) == ["step-10", "step-8"]
