"""engine/parity/noise.py's arithmetic (torch-free): the floor is a running maximum over the twins and
steps, the tolerance MARGIN x max(floor, float32 epsilon), the kernel twin always the other kernels,
and which settings need a floor. The floor measured on real runs is in tests/test_float8.py."""

from __future__ import annotations

import pytest

from engine.config import load_config
from engine.parity.compare import history_differences
from engine.parity.noise import (EPSILON, KERNEL_CAP_ENV, MARGIN, history_floor, inexact_settings,
                                 kernel_twin_env, step_tolerances)


def test_floor_is_the_running_maximum_over_twins_and_steps():
    reference = [(10.0, 1.0), (9.0, 1.0), (8.0, 1.0)]
    twin_a = [(10.0, 1.0), (9.0 * (1 + 1e-4), 1.0), (8.0, 1.0)]  # agrees again at step 3 by chance
    twin_b = [(10.0, 1.0 + 1e-6), (9.0, 1.0), (8.0, 1.0 + 3e-4)]
    floor = history_floor(reference, [twin_a, twin_b])
    assert floor == pytest.approx([1e-6, 1e-4, 3e-4])
    assert history_floor(reference, [reference]) == [0.0, 0.0, 0.0]
    assert history_floor(reference, [twin_a[:1]]) == [0.0, 0.0, 0.0]  # a short twin leaves later steps


def test_tolerance_is_margin_times_floor_at_least_one_epsilon():
    assert step_tolerances([0.0, 1e-9, 1e-4]) == pytest.approx([MARGIN * EPSILON, MARGIN * EPSILON, MARGIN * 1e-4])
    reference = [(10.0, 1.0), (9.0, 1.0)]
    within = [(10.0, 1.0 + 0.9 * MARGIN * EPSILON), (9.0 * (1 + 0.9 * MARGIN * 1e-4), 1.0)]
    beyond = [(10.0, 1.0), (9.0 * (1 + 1.1 * MARGIN * 1e-4), 1.0)]
    tolerances = step_tolerances([0.0, 1e-4])
    assert history_differences(within, reference, tolerances=tolerances)["passed"]
    verdict = history_differences(beyond, reference, tolerances=tolerances)
    assert not verdict["passed"] and verdict["first_failing_step"] == 2


def test_kernel_twin_is_always_the_other_kernels():
    capped, uncapped = kernel_twin_env({}), kernel_twin_env(dict(KERNEL_CAP_ENV))
    assert {k: v for k, v in capped.items() if k in KERNEL_CAP_ENV} == KERNEL_CAP_ENV
    assert {k: v for k, v in uncapped.items() if k in KERNEL_CAP_ENV} == {name: None for name in KERNEL_CAP_ENV}
    # each kernel choice compiles into its own inductor cache (its keys miss the choice)
    assert capped["TORCHINDUCTOR_CACHE_DIR"] != uncapped["TORCHINDUCTOR_CACHE_DIR"]


@pytest.mark.parametrize("overrides, want", [
    ([], []),
    (["--float8.enable", "true"], ["float8.enable = true (tensorwise)"]),
    (["--training.mixed_precision_param", "bfloat16"], ["training.mixed_precision_param = bfloat16"]),
    (["--optimizer.name", "Muon"], ["optimizer.muon_ns_dtype = bfloat16 (Muon)"]),
    (["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"], []),
])
def test_settings_that_need_a_floor(overrides, want):
    assert inexact_settings(load_config(overrides)) == want
