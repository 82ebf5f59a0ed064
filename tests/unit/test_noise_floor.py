"""engine/parity/noise.py's arithmetic (torch-free): the floor is a running maximum over the twins and
steps, the tolerance MARGIN x max(floor, float32 epsilon), the kernel twin always the other kernels,
and which settings need a floor. The floor measured on real runs is in tests/integration/test_float8.py."""

from __future__ import annotations

import os

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
    import tempfile  # not the run's working folder: a temporary one

    assert all(os.path.dirname(env["TORCHINDUCTOR_CACHE_DIR"]) == tempfile.gettempdir() for env in (capped, uncapped))


@pytest.mark.parametrize("overrides, want", [
    ([], []),
    (["--float8.enable", "true"], ["float8.enable = true (tensorwise)"]),
    (["--training.mixed_precision_param", "bfloat16"], ["training.mixed_precision_param = bfloat16"]),
    (["--optimizer.name", "Muon"], ["optimizer.muon_ns_dtype = bfloat16 (Muon)"]),
    (["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"], []),
])
def test_settings_that_need_a_floor(overrides, want):
    assert inexact_settings(load_config(overrides)) == want


def test_a_float8_layout_gets_the_reference_that_forwards_as_many_sequences(monkeypatch, tmp_path):
    """engine/parity/sweep.py under float8: each layout is judged against one process forwarding as
    many sequences at a time as its ranks (trained once per size, with its twins); a cp layout's
    floor also holds the run in half-size microbatches (scales regrouped). No launch: the runs are
    recorded, their histories made up."""
    import engine.parity.sweep as sweep_module
    from engine.parity.layouts import fit_batch, parse_layout
    from engine.parity.runs import RunResult

    launched = []

    def fake_launch(base_argv, overrides, world_size, folder, env=None):
        launched.append((os.path.basename(folder), overrides.get("training.local_batch_size"),
                         overrides.get("data.sequence_order_seed"), "ATEN_CPU_CAPABILITY" in (env or {})))
        bump = 1e-3 if "regrouped" in folder else 1e-6 * len(launched)  # every run differs from the others
        return RunResult(folder, [(10.0 + bump, 1.0), (9.0, 1.0 + bump)], 1.0)

    monkeypatch.setattr(sweep_module, "launch", fake_launch)
    sweep = sweep_module.Sweep([], 2, "float32", str(tmp_path), noise_floor=True, device_type="cpu",
                               local_batch_size=8, pp_microbatch_size=2, match_microbatches=True, say=lambda _: None)
    sweep.run_reference(max_norm=0.5)  # every norm clips
    assert [name for name, *_ in launched] == ["reference", "noise_twin_0", "noise_twin_1"]
    assert launched[1][2] == 1 and launched[2][3]  # the reordered twin, then the other kernels
    layouts = {name: fit_batch(parse_layout(name), 8, 8) for name in ("tp2", "fsdp2", "pp2", "cp2")}
    assert {name: sweep.forward_batch(layout) for name, layout in layouts.items()} == \
        {"tp2": 8, "fsdp2": 4, "pp2": 2, "cp2": 8}
    launched.clear()
    assert sweep.reference_for(layouts["tp2"])[0] is sweep.main and not launched
    reference, floor = sweep.reference_for(layouts["fsdp2"])
    assert reference.microbatch == 4 and floor == reference.floor and reference.floor
    assert [(name, mb) for name, mb, *_ in launched] == [("reference_mb4", 4), ("noise_twin_0_mb4", 4),
                                                        ("noise_twin_1_mb4", 4)]
    launched.clear()
    assert sweep.reference_for(fit_batch(parse_layout("fsdp2xtp2"), 8, 8))[0] is reference and not launched
    main, cp_floor = sweep.reference_for(layouts["cp2"])
    assert main is sweep.main and [(name, mb) for name, mb, *_ in launched] == [("regrouped_mb4", 4)]
    assert cp_floor[-1] > main.floor[-1]  # the regrouped run widens it
    sweep.match_microbatches = False  # fp32 / bf16: the config's reference for every layout
    assert sweep.reference_for(layouts["fsdp2"])[0] is sweep.main
