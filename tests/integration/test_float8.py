"""Float8 training (``[float8]``, parallelisms/float8.py): one process against a plain torchao loop, every
layout against one float8 process, checkpoints across float8 on/off, and a scale-from-the-shard defect.

Why the layouts agree: a tensorwise float8 cast is ``round(x * 448 / amax)``, so two runs quantize a
tensor alike exactly when they take its amax over the same elements. The weights' amax is over the
whole weight in every layout (FSDP: reduced over dp_shard, or over dp_shard × tp by the scale
precomputation; TP: the float8 linears see DTensors, whose amax torch reduces over tp), and the
activations' amax over the tokens of one forward, so each layout is compared with the one-process
run that splits the step into the same microbatches: 8 sequences for tp2 and cp2 (one forward of the
whole batch), 4 for fsdp2, pp2 (microbatch 4) and fsdp2×tp2 (each dp rank's 4 sequences). fsdp2 also
compiles its blocks, tp2 checkpoints them with the per-op policy.

Tolerances: a measured noise floor, not a number (engine/parity/noise.py, as ``./scripts/parity.py``
judges a float8 config). Float8 rounding is a step function, so another float32 summation order
flips single elements to the neighbouring float8 value and the next steps grow the flips; how far
depends on the CPU's kernels (a fixed 1e-3 at step 3, set on an AVX2 CPU, failed on an AVX-512 / AMX
one at 1.08e-3). Each one-process reference is therefore trained again in this run as its twins
(its sequences reordered; on the other CPU kernels, in a spawned process) and a layout passes step s within
``noise.MARGIN`` x the twins' largest difference up to s (at least float32's epsilon). Measured
here (AVX-512, relative, steps 1-3): the 8-sequence reference's floor 1.1e-7, 2.3e-5, 4.4e-4; the
4-sequence one's 7.1e-7, 3.3e-5, 3.1e-4; the plain loop 1.1e-7, 1.1e-7, 1.9e-5 from its reference,
tp2 0, 8.3e-8, 1.6e-5; a weight scale taken from one FSDP shard (the defect run) 1.1e-4 at step 1,
16 times the step-1 tolerance it has to pass.

Context parallel: its linears see a rank's half of each sequence, so an activation's amax is that
half's, a change of which tokens share a scale and no float order: its floor also holds the
difference between one process's runs with microbatches of 8 and of 4 (the same change of scale
grouping; measured 4.3e-5, 1.4e-3, 6.4e-3, against cp2's 5.1e-6, 9.0e-4, 5.2e-3).

CPU, gloo: torch 2.13's ``torch._scaled_mm`` has a CPU kernel. gloo cannot all-gather float8
tensors, so tp2 runs the family's tensor-parallel styles (the float8 linears cast the all-gathered
activation; the same float8 values as torchao's float8 styles, which a CUDA run uses). The tiny
LLaMA's linears (64, 128, 192 wide; 16 to 96 per rank under tp 2) are all multiples of 16, so every
block linear is float8; the output head stays float32 (``float8.filter_fqns``).
"""

from __future__ import annotations

import functools
import math

import pytest

from engine.parity.noise import REORDER, kernel_twin_env, history_floor, step_tolerances
from engine.testing.processes import run_distributed
from tests.extras import require_extra
from tests.integration.test_reference_loop import SETTINGS, _plain_loop
from tests.training_utils import base_args, run_in_turn, train_and_record


STEPS = 3
FLOAT8 = {**SETTINGS, "float8.enable": "true", "training.steps": STEPS, "validation.enable": "false"}
FSDP2 = {"parallelism.dp_shard": 2, "training.local_batch_size": 4}
AG = {"float8.fsdp_all_gather": "true"}
CKPT = {"checkpoint.enable": "true", "checkpoint.interval": 2}  # saves steps 2 and 3
# name: (overrides on FLOAT8, the one-process run it equals)
LAYOUTS_2 = {
    # compile (aot_eager: no code generation) of the float8 blocks, as tests/integration/test_tensor_parallel.py does
    "fsdp2": ({**FSDP2, "compile.enable": "true", "compile.backend": "aot_eager"}, "ref4"),
    "fsdp2_all_gather": ({**FSDP2, **AG, **CKPT}, "ref4"),
    "tp2": ({"parallelism.tp": 2, "parallelism.dp_shard": 1, "activation_checkpoint.mode": "selective"}, "ref8"),
    "pp2": ({"parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_microbatch_size": 4}, "ref4"),
    "cp2": ({"parallelism.cp": 2, "parallelism.dp_shard": 1}, "ref8"),
}
LAYOUTS_4 = {"fsdp2_tp2_all_gather": ({**FSDP2, **AG, "parallelism.tp": 2}, "ref4")}
# A checkpoint trained with float8 on resumed with it off (and the other way round): the same weights,
# matmuls rounded differently; the loss of the first resumed step moves by float8's rounding of one
# forward (measured 2.5e-4 and 1.5e-4 relative), far less than what that step changes the loss (the
# uninterrupted run's |loss 3 - loss 2|, 6e-3 to 5e-2 relative): at most this fraction of it.
CROSS_FRACTION = 0.1


def _singles(folder: str) -> dict:
    """The one-process runs: float8 with microbatches of 8 and 4, the plain torchao loop, and the
    checkpoints crossed between float8 on and off."""
    def run(name, overrides):
        return train_and_record(base_args(f"{folder}/{name.split(':')[0]}", overrides))

    out = {
        "ref8": run("on", {**FLOAT8, **CKPT}),
        "ref4": run("ref4", {**FLOAT8, "training.local_batch_size": 4}),
        # the noise floor's reordered twins (engine/parity/noise.py); the kernel twins: _kernel_twins
        "ref8:reordered": run("ref8_reordered", {**FLOAT8, **REORDER}),
        "ref4:reordered": run("ref4_reordered", {**FLOAT8, **REORDER, "training.local_batch_size": 4}),
        "off8": run("off", {**SETTINGS, **CKPT, "training.steps": STEPS}),
        # each resumes the other's checkpoint of step 2 and trains step 3
        "off_from_on": run("on:off", {**SETTINGS, **CKPT, "training.steps": STEPS, "checkpoint.load_step": 2}),
        "on_from_off": run("off:on", {**FLOAT8, **CKPT, "checkpoint.load_step": 2}),
    }
    out["plain"] = _plain_loop(8, float8_recipe="tensorwise")[:STEPS]
    return out


def _kernel_twins(folder: str) -> dict:
    """The one-process references again, in a process started on the other CPU kernels
    (engine/parity/noise.py's kernel_twin_env: another float32 summation order of every sum)."""
    return {name: train_and_record(base_args(f"{folder}/{name}", overrides))
            for name, overrides in (("ref8:kernels", FLOAT8), ("ref4:kernels", {**FLOAT8, "training.local_batch_size": 4}))}


def _rank_work(folder: str, layouts: dict) -> dict:
    """Inside every rank: each layout in turn, then (world 2) the resume and the defect runs."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    real_gather, gathers = Weight.fsdp_pre_all_gather, []

    @functools.wraps(real_gather)  # FSDP reads the hook's signature
    def counted(self, *args, **kwargs):  # (float8 all-gathers, those with a precomputed scale)
        gathers.append(self._precomputed_scale is not None)
        return real_gather(self, *args, **kwargs)

    def run_one(name, overrides):
        gathers.clear()
        Weight.fsdp_pre_all_gather = counted
        try:
            if name == "local_amax_defect":
                history = _with_local_amax(lambda: train_and_record(base_args(f"{folder}/{name}", overrides)))
            else:
                history = train_and_record(base_args(f"{folder}/{name.split(':')[0]}", overrides))
        finally:
            Weight.fsdp_pre_all_gather = real_gather
        history.float8_gathers = (len(gathers), sum(gathers))
        return history

    todo = {name: {**FLOAT8, **overrides} for name, (overrides, _) in layouts.items()}
    if "fsdp2_all_gather" in layouts:
        todo["fsdp2_all_gather:resume"] = {**todo["fsdp2_all_gather"], "checkpoint.load_step": 2}
        todo["local_amax_defect"] = {**FLOAT8, **FSDP2, **AG}
    return run_in_turn(todo, run_one)


def _with_local_amax(fn):
    """Run ``fn`` with each FSDP rank's float8 weight scale taken from its own shard (the defect of
    tests/parity_defects/sitecustomize.py's ``float8_local_amax``)."""
    from tests.parity_defects.sitecustomize import local_float8_amax

    restore = local_float8_amax()
    try:
        return fn()
    finally:
        restore()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require_extra("torchao")
    folder = str(tmp_path_factory.mktemp("float8"))
    (singles,) = run_distributed(_singles, 1, folder + "/one", torchrun_env=False, timeout=300)
    (kernels,) = run_distributed(_kernel_twins, 1, folder + "/kernels", torchrun_env=False, timeout=300,
                                env=kernel_twin_env())
    singles.update(kernels)
    world2 = run_distributed(_rank_work, 2, folder + "/two", LAYOUTS_2, timeout=400)
    world4 = run_distributed(_rank_work, 4, folder + "/four", LAYOUTS_4, timeout=300)
    return singles, {**world2[0], **world4[0]}, world2 + world4


def _history(value):
    assert not isinstance(value, str), value  # a traceback, or "not run"
    return value


def _floor(singles: dict, reference: str, *also: str) -> list[float]:
    """The noise floor of ``reference`` ("ref8" or "ref4") from its twins (and ``also``'s runs)."""
    twins = [_history(singles[f"{reference}:{twin}"]) for twin in ("reordered", "kernels")]
    return history_floor(_history(singles[reference]), twins + [_history(singles[name]) for name in also])


def test_one_process_equals_a_plain_torchao_loop(results):
    singles, _, _ = results
    assert_float8_parity(_history(singles["ref8"]), singles["plain"], _floor(singles, "ref8"))


def test_the_noise_floor_is_measured_and_not_zero(results):
    """Each twin is another float order of the same run: it differs from its reference (the twin
    took effect), and by little at step 1 (it is the same step: no twin changes the arithmetic)."""
    singles, _, _ = results
    for reference in ("ref8", "ref4"):
        ref = _history(singles[reference])
        for twin in ("reordered", "kernels"):
            floor = history_floor(ref, [_history(singles[f"{reference}:{twin}"])])
            assert floor[-1] > 0, (reference, twin, "bitwise equal: the twin changed no sum")
            assert floor[0] < 1e-5, (reference, twin, floor)


@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4])
def test_layout_equals_one_float8_process(layout, results):
    singles, layouts, every_rank = results
    name = {**LAYOUTS_2, **LAYOUTS_4}[layout][1]
    # cp2's scales group other tokens: its floor holds one process's regrouping too (module docstring)
    floor = _floor(singles, name, "ref4") if layout == "cp2" else _floor(singles, name)
    for rank_results in every_rank:  # every rank logs the same reduced loss and grad norm
        if layout in rank_results:
            assert_float8_parity(_history(rank_results[layout]), singles[name], floor)


def test_fsdp_gathers_float8_weights_with_precomputed_scales(results):
    """With float8.fsdp_all_gather every float8 weight is all-gathered as float8 (torchao's
    WeightWithDynamicFloat8CastTensor hook), each with the scale precomputed over the whole weight
    before the step; without it, none is."""
    _, layouts, _ = results
    for name in ("fsdp2_all_gather", "fsdp2_tp2_all_gather", "fsdp2_all_gather:resume"):
        total, precomputed = _history(layouts[name]).float8_gathers
        assert total > 0 and precomputed == total, (name, total, precomputed)
    assert _history(layouts["fsdp2"]).float8_gathers == (0, 0)


def test_scale_from_the_local_shard_fails_parity(results):
    """The defect run (weight scales from each rank's FSDP shard) is not the one-process run."""
    singles, layouts, _ = results
    with pytest.raises(AssertionError, match="step 1"):
        assert_float8_parity(_history(layouts["local_amax_defect"]), singles["ref4"], _floor(singles, "ref4"))


def test_float8_all_gather_resumes_bitwise(results):
    _, layouts, _ = results
    full, resumed = _history(layouts["fsdp2_all_gather"]), _history(layouts["fsdp2_all_gather:resume"])
    assert list(resumed) == list(full)[2:], (resumed, full)


def test_checkpoints_cross_float8_on_and_off(results):
    singles, _, _ = results
    for resumed, source in (("off_from_on", "ref8"), ("on_from_off", "off8")):
        got, want = _history(singles[resumed]), _history(singles[source])
        assert len(got) == 1, (resumed, got)  # step 3: it resumed step 2
        loss, ref, progress = got[0][0], want[2][0], abs(want[2][0] - want[1][0])
        assert abs(loss - ref) <= CROSS_FRACTION * progress, (resumed, loss, ref, progress)
    # the two precisions are told apart at all: float8 is not silently off in one of them
    assert singles["ref8"][-1][0] != singles["off8"][-1][0]


def assert_float8_parity(got, want, floor: list[float]) -> None:
    """Loss and grad norm of every step within engine/parity/noise.py's tolerance of ``floor``."""
    assert len(got) == len(want) == len(floor) == STEPS, (list(got), list(want), floor)
    for step, ((loss, norm), (ref_loss, ref_norm), tol) in enumerate(zip(got, want, step_tolerances(floor)), start=1):
        assert math.isclose(loss, ref_loss, rel_tol=tol), f"step {step}: loss {loss} vs {ref_loss} (tolerance {tol:.2e})"
        assert math.isclose(norm, ref_norm, rel_tol=tol), \
            f"step {step}: grad_norm {norm} vs {ref_norm} (tolerance {tol:.2e})"
