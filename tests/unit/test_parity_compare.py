"""engine/parity/compare.py's rules, each at its boundary (written against its surviving mutants,
scripts/mutation.sh): an empty history, ties, a difference exactly at the tolerance, empty and zero
tensors, a shape mismatch before other tensors, the clipping margin's both sides, and the max_norm
that engages clipping for spread and for narrow norms."""

from __future__ import annotations

import math

import pytest
import torch

from engine.parity.compare import (CLIP_MARGIN, clipping_sides, engaging_max_norm, history_differences,
                                   parameter_differences, relative_difference, tensor_difference)


def test_relative_difference_of_a_zero_reference():
    assert relative_difference(1.0, 0.0) == math.inf
    assert relative_difference(0.0, 0.0) == 0.0
    assert relative_difference(float("nan"), 1.0) == math.inf


def test_an_empty_history_passes_with_zero_differences():
    assert history_differences([], []) == {"loss": 0.0, "grad_norm": 0.0, "loss_step": None, "grad_norm_step": None,
                                           "first_failing_step": None, "passed": True}


def test_the_worst_difference_is_the_first_step_that_reaches_it():
    want = [(1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]
    got = [(1.0 + 1e-6, 1.0), (1.0 + 3e-6, 1.0 + 2e-6), (1.0 + 3e-6, 1.0 + 2e-6)]
    out = history_differences(got, want)
    assert out["loss"] == pytest.approx(3e-6) and out["loss_step"] == 2
    assert out["grad_norm"] == pytest.approx(2e-6) and out["grad_norm_step"] == 2
    assert out["passed"]


def test_a_difference_exactly_at_the_tolerance_passes():
    assert history_differences([(1.5, 1.0)], [(1.0, 1.0)], tolerances=[0.5])["passed"]
    assert not history_differences([(1.5, 1.0)], [(1.0, 1.0)], tolerances=[0.25])["passed"]


def test_tensor_difference_of_empty_and_zero_tensors():
    empty = torch.zeros(0)
    assert tensor_difference(empty, empty) == (0.0, 0.0)
    assert tensor_difference(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)
    assert tensor_difference(torch.ones(3), torch.zeros(3)) == (1.0, math.inf)


def test_parameter_differences_name_the_worst_and_every_mismatch():
    want = {"a": torch.zeros(2), "b": torch.ones(2), "c": torch.ones(2), "d": torch.ones(2)}
    got = {"a": torch.zeros(3), "b": torch.tensor([1.0, 1.5]), "c": torch.tensor([1.5, 1.0]), "d": torch.ones(2),
           "e": torch.ones(1)}
    worst, name, missing = parameter_differences(got, want)
    # "a" mismatches its shape first; "b" and "c" tie at 0.5 after it: the first keeps the name
    assert (worst, name) == (0.5, "b")
    assert missing == ["e", "a (shape (3,) vs (2,))"]
    assert parameter_differences({"x": torch.ones(2)}, {"x": torch.ones(2)}) == (0.0, "x", [])


def test_clipping_sides_count_only_norms_clear_of_the_margin():
    assert clipping_sides([(1.0, 0.5), (1.0, 2.0)], 0.0) == (0, 2)  # max_norm <= 0: no clipping
    edge = 1.0 * (1 + CLIP_MARGIN)
    assert clipping_sides([(1.0, edge), (1.0, 1.05), (1.0, 0.95)], 1.0) == (0, 0)  # within the margin
    assert clipping_sides([(1.0, 1.2), (1.0, 0.8), (1.0, 0.85)], 1.0) == (1, 2)


def test_engaging_max_norm_between_spread_norms_else_below_the_smallest():
    assert engaging_max_norm([]) == 1.0
    # non-finite and zero norms are left out; spread norms: their geometric mean
    assert engaging_max_norm([(1.0, float("nan")), (1.0, 0.0), (1.0, 1.0), (1.0, 2.0), (1.0, 4.0)]) == 2.0
    assert engaging_max_norm([(1.0, 1.0), (1.0, 1.3)]) == float(f"{math.sqrt(1.3):.3g}")
    # narrow norms (within the margin both ways, and 2 % more): 0.8 x the smallest clips every step
    narrow = (1 + CLIP_MARGIN) ** 2 * 1.02
    assert engaging_max_norm([(1.0, 1.0), (1.0, narrow)]) == 0.8
    assert engaging_max_norm([(1.0, 1.0), (1.0, 1.21)]) == 0.8
