"""Config keys are classified (convergence / numerics / execution), the fingerprint follows the
convergence keys only, and ``python -m engine.config diff`` says whether two configs are the same run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from engine.config import JobConfig, config_to_toml
from engine.config.fingerprint import CONVERGENCE, EXECUTION, KEY_CLASS, NUMERICS, changes, fingerprint, key_class
from tests.training_utils import train_to_end

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")


def _schema_keys() -> list[str]:
    cfg = JobConfig()
    return [f"{section.name}.{key.name}" for section in dataclasses.fields(cfg)
            for key in dataclasses.fields(getattr(cfg, section.name))]


def test_every_schema_key_has_exactly_one_class():
    keys = _schema_keys()
    unclassified = [key for key in keys if key not in KEY_CLASS]
    assert not unclassified, f"classify these keys in engine/config/fingerprint.py: {unclassified}"
    assert sorted(KEY_CLASS) == sorted(keys), f"classified but not in the schema: {set(KEY_CLASS) - set(keys)}"
    with pytest.raises(KeyError, match="no class"):
        key_class("training.new_key")


def _tables(**changes_by_key) -> dict:
    tables = tomllib.loads(config_to_toml(JobConfig()))
    for key, value in changes_by_key.items():
        section, name = key.split("__")
        tables[section][name] = value
    return tables


@pytest.mark.parametrize("key, value, same", [
    ("parallelism__tp", 2, True), ("training__local_batch_size", 2, True), ("metrics__log_freq", 1, True),
    ("activation_checkpoint__mode", "full", True), ("compile__enable", True, True),  # numerics
    ("training__mixed_precision_param", "bfloat16", True),
    ("optimizer__lr", 1e-3, False), ("training__seed", 1, False), ("data__shuffle", False, False),
    ("model__flavor", "8B", False), ("training__steps", 7, False), ("lr_scheduler__warmup_steps", 3, False),
    # Which updates are applied changes the model; when to give up on skips does not.
    ("step_health__on_nonfinite", "skip", False), ("step_health__loss_spike_sigma", 6.0, False),
    ("step_health__window", 64, False), ("step_health__max_consecutive_skips", 1, True),
])
def test_fingerprint_follows_convergence_keys_only(key, value, same):
    assert (fingerprint(_tables(**{key: value})) == fingerprint(_tables())) is same


def test_local_batch_sets_the_global_batch_when_it_is_minus_one():
    base = _tables(training__global_batch_size=16)
    assert changes(base, _tables(training__global_batch_size=16, training__local_batch_size=2))[0][1] == EXECUTION
    auto = _tables(training__global_batch_size=-1)
    assert changes(auto, _tables(training__global_batch_size=-1, training__local_batch_size=2))[0][1] == CONVERGENCE


def _diff(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "engine.config", "diff", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)


def test_diff_execution_only_is_the_same_run():
    result = _diff(DEBUG, DEBUG, "--parallelism.tp", "2", "--training.local_batch_size", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["training.local_batch_size", EXECUTION, "4", "->", "2"]
    assert lines[-1] == "execution only: the same run"


def test_diff_lists_convergence_and_numerics_changes():
    result = _diff(DEBUG, DEBUG, "--optimizer.lr", "1e-3", "--compile.enable", "true", "--parallelism.tp", "2")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert f"{CONVERGENCE} changes: optimizer.lr" in lines and f"{NUMERICS} changes: compile.enable" in lines
    assert lines[-3].startswith("fingerprints: ") and len(set(lines[-3].split()[1::2])) == 2


def test_diff_refuses_a_bad_config_in_one_line():
    result = _diff(DEBUG, DEBUG, "--optimizer.lrr", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "config error" in result.stderr
    assert _diff(DEBUG).returncode == 2


_train = train_to_end  # (tests/training_utils.py)


def test_fingerprint_in_metrics_and_checkpoints_and_a_changed_one_on_resume(tmp_path):
    import json

    from engine.testing.processes import run_distributed
    from tests.training_utils import base_args

    folder = tmp_path / "run"
    common = {"checkpoint.enable": "true", "validation.enable": "false"}
    run_distributed(_train, 1, base_args(str(folder), {**common, "training.steps": 2}), torchrun_env=False)
    # Execution only (log_freq), then a convergence change (the learning rate) on resume.
    run_distributed(_train, 1, base_args(str(folder), {**common, "training.steps": 3, "metrics.log_freq": 2}),
                    torchrun_env=False)
    run_distributed(_train, 1, base_args(str(folder), {**common, "training.steps": 4, "optimizer.lr": "1e-3"}),
                    torchrun_env=False)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    runs = [r for r in records if r["kind"] == "run"]
    assert [r["step"] for r in runs] == [1, 3, 4]
    first, second, third = runs
    marker = json.loads((folder / "checkpoint" / "step-2" / "quadra.json").read_text())
    assert marker["fingerprint"] == first["fingerprint"] and len(first["fingerprint"]) == 16
    # training.steps is a convergence key (it sets the LR decay): 2 -> 3 is a change too.
    assert second["fingerprint_change"]["keys"] == ["training.steps"]
    assert third["fingerprint_change"] == {"from": second["fingerprint"], "to": third["fingerprint"],
                                           "keys": ["training.steps", "optimizer.lr"]}


def test_a_feature_left_off_keeps_the_fingerprint_of_runs_before_its_key():
    """``[document_mask]`` off hashes like a config written before the section existed; on, it differs."""
    from engine.config.fingerprint import fingerprint

    before = {"training": {"seq_len": 256}, "optimizer": {"lr": 3e-4}}
    off = {**before, "document_mask": {"enable": False, "restart_positions": False}}
    assert fingerprint(off) == fingerprint(before)
    for key in ("enable", "restart_positions"):
        assert fingerprint({**before, "document_mask": {**off["document_mask"], key: True}}) != fingerprint(before)
