"""[fault_tolerance]'s config rules and the data split over replica groups, without launching anything
(the launched runs are in tests/integration/test_fault_tolerance.py)."""

from __future__ import annotations

import importlib.util

import pytest

from engine.config import load_config
from engine.config.validation import fault_tolerance_problems
from engine.train.fault_tolerance import data_ranks


def _cfg(*overrides: str):
    return load_config(["--fault_tolerance.enable", "true", *overrides])


def test_fault_tolerance_without_torchft_is_refused_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr("engine.config.extras.find_spec", lambda name: None if name == "torchft" else real(name))
    cfg = _cfg()
    assert fault_tolerance_problems(cfg.fault_tolerance, cfg.parallelism) == [
        'fault_tolerance.enable = true: needs torchft, which is not installed; install it with pip install -e ".[ft]"']
    with pytest.raises(ValueError, match=r'pip install -e "\.\[ft\]"'):
        cfg.validate()


@pytest.mark.parametrize("overrides, line", [
    (("--parallelism.dp_replicate", "2"), "parallelism.dp_replicate = 2: must be 1 with fault_tolerance.enable: the "
     "replica groups are the replicas; set fault_tolerance.group_size = 2 instead"),
    (("--fault_tolerance.replica_id", "2"), "fault_tolerance.replica_id = 2: must be -1 (every group on this node) "
     "or 0 .. group_size-1 = 1"),
    (("--fault_tolerance.min_replica_size", "3"), "fault_tolerance.min_replica_size = 3: must be in 1 .. group_size = 2"),
    (("--fault_tolerance.group_size", "0"), "fault_tolerance.group_size = 0: must be >= 1 replica groups"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(overrides, line, monkeypatch):
    cfg = _cfg(*overrides)
    assert line in fault_tolerance_problems(cfg.fault_tolerance, cfg.parallelism)


def test_off_checks_nothing():
    cfg = load_config(["--parallelism.dp_replicate", "2", "--fault_tolerance.replica_id", "7"])
    assert fault_tolerance_problems(cfg.fault_tolerance, cfg.parallelism) == []


def test_the_groups_are_the_outer_data_parallel_dimension():
    """Group g's dp rank r reads what HSDP's dp rank g x dp + r reads (HSDP's dp ranks are replicate-major)."""
    cfg = _cfg("--fault_tolerance.group_size", "3", "--fault_tolerance.replica_id", "2")
    assert data_ranks(cfg.fault_tolerance, dp=4, dp_rank=1) == (12, 9)
    assert data_ranks(load_config([]).fault_tolerance, dp=4, dp_rank=1) == (4, 1)
