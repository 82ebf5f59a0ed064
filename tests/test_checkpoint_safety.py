"""Checkpoint safety: bad checkpoint settings stop every rank before training with a clear message,
and SIGTERM through ./run_train.sh saves, exits 0, and a rerun continues the same loss curve."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

import pytest

from engine.trainer import Trainer  # noqa: F401 - imported once here, so forked workers start warm
from tests.checkpoint_utils import STEPS, train_run, write_tiny_corpus
from tests.dist_utils import run_distributed
from tests.training_utils import REPO, base_args


def _setup_errors(argv_list: list[list[str]]) -> list[str]:
    """Build a Trainer for each argv; -> the error each raised ("no error" if none)."""
    from engine.config import load_config
    from engine.trainer import Trainer

    messages = []
    for argv in argv_list:
        cfg = load_config(argv)
        cfg.validate()
        try:
            trainer = Trainer(cfg)
        except ValueError as error:
            messages.append(f"{type(error).__name__}: {error}")
            continue
        trainer.close()
        messages.append("no error")
    return messages


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory) -> str:
    """A run folder whose checkpoint folder holds a seed checkpoint (step-0, model weights only)."""
    from engine.checkpoint_tools import save_seed_checkpoint
    from engine.config import load_config

    folder = str(tmp_path_factory.mktemp("seeded"))
    cfg = load_config(base_args(folder, {"checkpoint.enable": "true"}))
    save_seed_checkpoint(cfg)
    return folder


def test_bad_checkpoint_settings_fail_before_training(seeded_run, tmp_path):
    not_dcp = tmp_path / "not_a_checkpoint"
    not_dcp.mkdir()
    cases = {
        "load_step": ({"checkpoint.load_step": 3},
                      ["checkpoint.load_step = 3", "no complete checkpoint step-3", "complete: [0]"]),
        "other model": ({"model.vocab_size": 4200},
                        ["does not fit this model", "model weight 'output.weight' has shape [4096, 256] in "
                         "the checkpoint but [4200, 256] in this model"]),
        "fresh run from an incompatible folder": (
            {"job.dump_folder": str(tmp_path / "fresh"), "model.vocab_size": 4200,
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint", "step-0")},
            ["does not fit this model", "'output.weight'"]),
        "initial_load_path": ({"job.dump_folder": str(tmp_path / "fresh2"),
                               "checkpoint.initial_load_path": str(not_dcp)},
                              ["checkpoint.initial_load_path", "is not a DCP checkpoint folder"]),
        "full load of weights only": (
            {"job.dump_folder": str(tmp_path / "fresh3"), "checkpoint.initial_load_model_only": "false",
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint", "step-0")},
            ["holds no training state", "checkpoint.initial_load_model_only = true"]),
    }
    argv_list = [base_args(seeded_run, {"checkpoint.enable": "true", **overrides})
                 for overrides, _ in cases.values()]
    messages = run_distributed(_setup_errors, 1, argv_list, torchrun_env=False)[0]
    for (name, (_, fragments)), message in zip(cases.items(), messages):
        assert message.startswith("CheckpointError"), (name, message)
        for fragment in fragments:
            assert fragment in message, (name, fragment, message)
    # Nothing was trained or saved over the seed.
    assert sorted(os.listdir(os.path.join(seeded_run, "checkpoint"))) == ["step-0"]


def test_unwritable_folder_fails_on_every_rank(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    argv = base_args(str(tmp_path), {"checkpoint.enable": "true", "checkpoint.folder": str(blocker / "ckpt"),
                                     "parallelism.dp_shard": 2, "training.local_batch_size": 4})
    messages = [m[0] for m in run_distributed(_setup_errors, 2, [argv])]
    for message in messages:  # rank 1 did not check the folder, but says the same
        assert "checkpoint.folder" in message and "cannot be written" in message and "NotADirectoryError" in message
    assert messages[0] == messages[1]


# ---------------------------------------------------------------- SIGTERM through run_train.sh
def _launch(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1")
    env.pop("CONFIG_FILE", None)
    return subprocess.Popen([os.path.join(REPO, "run_train.sh"), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _train_steps(folder: str) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == "train"]


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_train.sh did not finish:\n{out[-3000:]}")
    return out


def test_sigterm_saves_and_the_same_command_continues_the_curve(tmp_path):
    corpus = write_tiny_corpus(str(tmp_path))
    settings = {"data.path": corpus, "training.steps": STEPS, "training.seq_len": 64, "validation.enable": "false",
                "training.local_batch_size": 2, "training.global_batch_size": 8, "training.gc_freq": 0,
                "lr_scheduler.warmup_steps": 2, "metrics.log_freq": 1, "checkpoint.interval": 100,
                "job.print_config": "false", "comm.init_timeout_seconds": 60}
    folder = str(tmp_path / "run")
    args = [f"--{k}={v}" for k, v in {"job.dump_folder": folder, **settings}.items()]

    proc = _launch(args)
    deadline = time.monotonic() + 240
    while len(_train_steps(folder)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # to the script only, as `kill <pid>` or a scheduler would
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    stopped_at = _train_steps(folder)[-1]["step"]
    assert stopped_at < STEPS, "the run ended before the signal arrived"
    assert f"received SIGTERM: saved checkpoint step-{stopped_at}, exiting" in out, out[-3000:]
    assert os.listdir(os.path.join(folder, "checkpoint")) == [f"step-{stopped_at}"]

    proc = _launch(args)  # the same command again
    out = _finish(proc)
    assert proc.returncode == 0 and f"resumed from {folder}/checkpoint/step-{stopped_at}" in out, out[-3000:]
    records = _train_steps(folder)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "one continuous curve, no step twice"

    # The curve is the uninterrupted run's, bitwise (same layout, same arithmetic).
    config = os.path.join(REPO, "train_configs", "debug_model.toml")
    reference_args = ["--job.config_file", config, *args, f"--job.dump_folder={tmp_path / 'reference'}"]
    reference = run_distributed(train_run, 2, reference_args)[0]["losses"]
    assert {r["step"]: r["loss"] for r in records} == reference

    # TensorBoard: the rerun appends a second events file in the same folder; together one curve.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(glob.glob(os.path.join(folder, "tb", "events.out.tfevents.*"))) == 2
    events = EventAccumulator(os.path.join(folder, "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
