"""Checkpoint safety: bad checkpoint settings stop every rank before training with a clear message.
(Stop signals through ./run_train.sh are in tests/integration/test_launch.py.)"""

from __future__ import annotations

import os

import pytest

from models import get_model_args
from engine.testing.processes import run_distributed
from tests.training_utils import FLAVOR, base_args



def _setup_errors(argv_list: list[list[str]]) -> list[str]:
    """Build a Trainer for each argv; -> the error each raised ("no error" if none)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

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
    from engine.convert.tools import save_seed_checkpoint
    from engine.config import load_config

    folder = str(tmp_path_factory.mktemp("seeded"))
    cfg = load_config(base_args(folder, {"checkpoint.enable": "true"}))
    save_seed_checkpoint(cfg)
    return folder


def test_bad_checkpoint_settings_fail_before_training(seeded_run, tmp_path):
    not_dcp = tmp_path / "not_a_checkpoint"
    not_dcp.mkdir()
    dim = get_model_args("llama", FLAVOR).dim
    step_10 = tmp_path / "other_run" / "step-10"
    step_10.mkdir(parents=True)
    (step_10 / ".metadata").write_bytes(b"")
    (step_10 / "quadra.json").write_text('{"step": 10}')
    cases = {
        "load_step": ({"checkpoint.load_step": 3},
                      ["checkpoint.load_step = 3", "no complete checkpoint step-3", "complete: [0]"]),
        "other model": ({"model.vocab_size": 4200},
                        ["does not fit this model", f"model weight 'output.weight' has shape [4096, {dim}] in "
                         f"the checkpoint but [4200, {dim}] in this model"]),
        # The seed's quadra.json records its model: the pre-flight compares before anything is built.
        "fresh run from an incompatible folder": (
            {"job.dump_folder": str(tmp_path / "fresh"), "model.vocab_size": 4200,
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint", "step-0")},
            [f"holds another model than llama/{FLAVOR} (vocab_size=4096 vs 4200)", "--model.args_path"]),
        "initial_load_path": ({"job.dump_folder": str(tmp_path / "fresh2"),
                               "checkpoint.initial_load_path": str(not_dcp)},
                              ["checkpoint.initial_load_path", "is not a DCP checkpoint folder"]),
        "initial_load_path missing": (
            {"job.dump_folder": str(tmp_path / "fresh4"),
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint", "step-9")},
            ["step-9' does not exist", "checkpoint holds step-0"]),
        "initial_load_path a run's folder": (
            {"job.dump_folder": str(tmp_path / "fresh5"),
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint")},
            ["is a run's checkpoint folder, not one checkpoint", "e.g. the newest: " + os.path.join(
                seeded_run, "checkpoint", "step-0")]),
        "full load of weights only": (
            {"job.dump_folder": str(tmp_path / "fresh3"), "checkpoint.initial_load_model_only": "false",
             "checkpoint.initial_load_path": os.path.join(seeded_run, "checkpoint", "step-0")},
            ["holds no training state", "checkpoint.initial_load_model_only = true"]),
        # A full checkpoint at step 10 (its marker says so) and a phase continuing it to step 10.
        "new phase with no step to train": (
            {"job.dump_folder": str(tmp_path / "fresh6"), "checkpoint.initial_load_model_only": "false",
             "checkpoint.initial_load_path": str(step_10), "training.steps": 10},
            ["training.steps = 10 is not above the step of checkpoint.initial_load_path", "(10)",
             "Fix: --training.steps N with N > 10", "--checkpoint.initial_load_lr restart"]),
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
