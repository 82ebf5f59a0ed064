"""scripts/benchmarks/harness.py: the measurement rules of scripts/benchmark.py (the benchmark itself
takes minutes and is not part of the suite)."""

from __future__ import annotations

import pytest

from scripts.benchmarks import harness


def test_stat_median_and_quartiles():
    stat = harness.Stat.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (stat.median, stat.p25, stat.p75, stat.n) == (3.0, 2.0, 4.0, 5)
    assert stat.spread == pytest.approx(2.0 / 3.0)


def test_interleave_rotates_the_order_every_round():
    calls = []
    variants = {name: (lambda n=name: calls.append(n) or [1.0]) for name in "abc"}
    samples = harness.interleave(variants, rounds=3)
    assert calls == list("abc" "bca" "cab")
    assert samples == {"a": [1.0] * 3, "b": [1.0] * 3, "c": [1.0] * 3}


def test_ratio_is_of_medians_and_its_quartiles_bracket_it():
    # Per-step seconds for which the old spread (quartiles of equal-rank pairwise ratios) was
    # 0.931-1.018 around a median ratio of 1.038: a reported ratio outside its own spread.
    compiled = [0.85, 0.93, 0.97, 1.08, 1.09, 1.13, 1.17]
    eager = [0.92, 1.0, 1.04, 1.04, 1.07, 1.14, 1.15]
    stat = harness.ratio_stat(compiled, eager)
    assert stat.median == pytest.approx(1.08 / 1.04) and stat.n == 7
    assert stat.p25 < stat.median < stat.p75
    assert harness.ratio_stat(compiled, eager) == stat  # seeded: the same samples give the same row
    same = harness.ratio_stat([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert (same.median, same.p25, same.p75) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="no samples"):
        harness.ratio_stat([], [1.0])


def test_busy_machine_is_refused(monkeypatch):
    monkeypatch.setattr(harness, "other_load", lambda seconds=1.0: 0.9)
    with pytest.raises(harness.MachineBusyError, match="90% of .* cores are busy.*--max-load 0.25"):
        harness.guard_load(0.25, "case loop")
    monkeypatch.setattr(harness, "other_load", lambda seconds=1.0: 0.1)
    assert harness.guard_load(0.25, "case loop") == 0.1


def test_other_load_is_a_fraction():
    assert 0.0 <= harness.other_load(0.2) <= 1.0
