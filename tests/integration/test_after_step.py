"""A failure after a trained step (validation, metrics, the profiler's trace) never loses the step.

The loop saves each due checkpoint, and at the last step waits for it to be complete, before it
reports or validates (engine/train/trainer.py); a failure there ends the run with one line naming the
phase, the step and the newest complete checkpoint, and the same command resumes from it.
"""

from __future__ import annotations

import os

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import base_args, train_and_record


SETTINGS = {"training.steps": 6, "checkpoint.enable": "true", "checkpoint.interval": 2, "validation.freq": 2}


def _main_failing(argv: list[str], error_dir: str, phase: str, fail_at: int) -> int:
    """engine.train.main with ``phase`` raising after step ``fail_at`` (injected in this forked process)."""
    os.environ["QUADRA_ERROR_DIR"] = error_dir
    from engine.train import main as train
    from engine.observe.metrics import MetricsLogger
    from engine.checkpoint import CheckpointManager
    from engine.train.trainer import Trainer

    owner, name = {"validation": (Trainer, "validate"), "metrics": (MetricsLogger, "log"),
                   "checkpoint save": (CheckpointManager, "maybe_save")}[phase]
    original = getattr(owner, name)

    def failing(self, *args, **kwargs):
        step = self.step if isinstance(self, Trainer) else args[0]
        if step == fail_at:
            raise PermissionError(f"injected {phase} failure")
        return original(self, *args, **kwargs)

    setattr(owner, name, failing)
    return train.main(argv)


def _resume(argv: list[str]) -> tuple[int, list]:
    """(the step the run resumed at, [(loss, grad_norm)] of the steps it trained)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    resumed_at = trainer.step
    try:
        return resumed_at, [(h["loss"], h["grad_norm"]) for h in trainer.train()]
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """[(loss, grad_norm)] of the whole run of each setting, trained once per setting: the cases
    without overrides share one run."""
    runs: dict[str, list] = {}

    def get(overrides: dict) -> list:
        key = repr(sorted(overrides.items()))
        if key not in runs:
            folder = str(tmp_path_factory.mktemp("whole"))
            (runs[key],) = run_distributed(train_and_record, 1, base_args(folder, {**SETTINGS, **overrides}),
                                           torchrun_env=False)
        return runs[key]

    return get


@pytest.mark.parametrize("phase, fail_at, overrides, newest", [
    ("validation", 4, {}, 4),                                   # mid-run, sync checkpoint of that step
    ("metrics", 4, {}, 4),                                      # the metrics record of step 4
    ("validation", 6, {"checkpoint.async_mode": "async"}, 6),   # the last step, its save in flight
    ("checkpoint save", 4, {}, 2),                              # the save itself (a full disk): step 2 is kept
])
def test_failure_after_a_step_keeps_it_and_resumes(phase, fail_at, overrides, newest, uninterrupted, tmp_path):
    settings = {**SETTINGS, **overrides}
    argv = base_args(str(tmp_path / "run"), settings)
    error_dir = tmp_path / "errors"
    error_dir.mkdir()
    (status,) = run_distributed(_main_failing, 1, argv, str(error_dir), phase, fail_at, torchrun_env=False)
    assert status == 1
    (line,) = (error_dir / "rank0.err").read_text().splitlines()  # one line
    assert line.startswith(f"training stopped: {phase} after step {fail_at} failed (PermissionError: injected "), line
    assert f"checkpoint step-{newest} is complete; the same command resumes from it" in line, line
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(folder)) == [f"step-{s}" for s in range(2, newest + 1, 2)]

    (resumed,) = run_distributed(_resume, 1, argv, torchrun_env=False)
    resumed_at, history = resumed
    assert resumed_at == newest
    assert history == uninterrupted(overrides)[newest:]  # bitwise: the step that failed to report was not lost
