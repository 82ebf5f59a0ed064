"""Helpers of the checkpoint tests: a corpus that re-loops within 10 steps, a training run that can
stop at a step (SIGTERM or a step limit) and records the data windows it read, checkpoint contents."""

from __future__ import annotations

import json
import math
import os
import shutil

import torch

from tests.training_utils import SMALL_CORPUS, base_args

STEPS = 10
STOP = 5
# 6 documents x 440 characters = 28 windows of 33 tokens (the tests' seq_len 32): 10 steps of 8
# windows read the data ~2.9 times, and the first epoch ends in the middle of step 4.
TINY_DOCS, TINY_CHARS, TINY_WINDOWS = 6, 440, 28


def write_tiny_corpus(folder: str) -> str:
    path = os.path.join(folder, "tiny.jsonl")
    with open(SMALL_CORPUS, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        for line, _ in zip(src, range(TINY_DOCS)):
            out.write(json.dumps({"text": json.loads(line)["text"][:TINY_CHARS]}) + "\n")
    return path


def ckpt_args(folder: str, corpus: str, overrides: dict | None = None) -> list[str]:
    """A 10-step fp32 run of the tests' base setting with checkpoints every 5 steps."""
    settings = {"data.path": corpus, "training.steps": STEPS, "checkpoint.enable": "true",
                "checkpoint.interval": STOP, "metrics.log_freq": STEPS}
    settings.update(overrides or {})
    return base_args(folder, settings)


def train_run(argv: list[str], steps: int | None = None, signal_at: tuple[int, int] | None = None) -> dict:
    """Build a Trainer (resuming if its folder has a checkpoint) and train; runs in a test worker.

    Args:
        steps: train this many steps (the test hook that stops a run early), else to the end.
        signal_at: (rank, step): that rank sends itself SIGTERM right after that step.

    Returns:
        {"losses": {step: loss}, "start_step", "start_position", "end_position", "stopped_by",
         "windows": global window positions this rank read, "dp_rank", "tokens_seen"}.
    """
    import signal

    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    start = (trainer.step, trainer.dataloader.state_dict()["position"])
    windows: list[int] = []
    gather = trainer.dataloader.source.gather

    def recording_gather(indices):
        windows.extend(indices)
        return gather(indices)

    trainer.dataloader.source.gather = recording_gather
    if signal_at is not None:
        train_step = trainer.train_step

        def step_then_signal():
            record = train_step()
            if (trainer.dist.rank, trainer.step) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return record

        trainer.train_step = step_then_signal
    try:
        history = trainer.train(steps)
    finally:
        trainer.close()
    return {
        "losses": {h["step"]: h["loss"] for h in history},
        "start_step": start[0],
        "start_position": start[1],
        "end_position": trainer.dataloader.state_dict()["position"],
        "stopped_by": trainer.stopped_by,
        "windows": windows,
        "dp_rank": trainer.dp_rank,
        "tokens_seen": trainer.tokens_seen,
    }


def copy_checkpoint(src_run: str, dst_run: str, step: int) -> None:
    """Put ``step-N`` of one run folder into a fresh run folder (a run stopped after step N)."""
    shutil.copytree(os.path.join(src_run, "checkpoint", f"step-{step}"),
                    os.path.join(dst_run, "checkpoint", f"step-{step}"))


def read_checkpoint(path: str, tmp_file: str) -> dict:
    """Every entry of a DCP checkpoint as a flat {key: value} (tensors in full), one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from engine.checkpoint.state import quiet_single_process

    with quiet_single_process():
        dcp_to_torch_save(path, tmp_file)
    nested = torch.load(tmp_file, weights_only=False)
    os.remove(tmp_file)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            flat[prefix] = value

    walk("", nested)
    return flat


def assert_bitwise_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:5]}"
    for key in sorted(want):
        a, b = got[key], want[key]
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {key} differs (max |diff| " \
                f"{(a.double() - b.double()).abs().max().item() if a.shape == b.shape else a.shape})"
        else:
            assert a == b, f"{what}: {key} = {a!r} vs {b!r}"


def assert_losses_close(got: dict[int, float], want: dict[int, float], rel: float) -> float:
    """Same steps; every loss within ``rel`` (relative). -> the largest relative difference."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst = 0.0
    for step in sorted(want):
        diff = abs(got[step] - want[step]) / abs(want[step])
        worst = max(worst, diff)
        assert math.isclose(got[step], want[step], rel_tol=rel), f"step {step}: {got[step]} vs {want[step]}"
    return worst
