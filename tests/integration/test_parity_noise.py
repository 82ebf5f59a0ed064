"""The parity sweep of ./scripts/parity.py judging a float8 config against its measured noise floor
(engine/parity/noise.py), through the real launcher: fsdp2, tp2 and fsdp2×tp2 pass on a correct tree
(under the fixed fp32 tolerance every float8 layout failed on its parameters), and a float8 weight
scale taken from one FSDP shard (tests/parity_defects/sitecustomize.py) fails. The floor's arithmetic
is in tests/unit/test_noise_floor.py; the float8 layouts themselves in tests/integration/test_float8.py; bfloat16 in
tests/integration/test_parity_noise_bf16.py."""

from __future__ import annotations

import os

import pytest

from engine.parity.compare import TOLERANCES
from engine.parity.layouts import ParityLayout, fit_batch, parse_layout
from engine.parity.sweep import Sweep, format_table
from tests.extras import require_extra
from tests.training_utils import MAX_NORM, REPO, base_args


DEFECTS = os.path.join(REPO, "tests", "parity_defects")
STEPS = 3


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    require_extra("torchao")
    folder = str(tmp_path_factory.mktemp("parity_noise"))
    # microbatches of 4 (global batch 8): the reference forwards as many sequences at a time as every
    # layout's ranks (fsdp2: 4 each; tp2: 4 twice), so one reference serves them all (the choice of a
    # matched reference is tested without launches in tests/unit/test_noise_floor.py)
    argv = base_args(os.path.join(folder, "unused"), {"float8.enable": "true", "validation.enable": "false",
                                                       "training.local_batch_size": 4})
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([DEFECTS, REPO])}
    out = Sweep(argv, STEPS, "float32", folder, engage_clipping=False, env=env, noise_floor=True,
                device_type="cpu", local_batch_size=4, match_microbatches=True)
    out.run_reference(MAX_NORM)
    rows = {name: out.compare(fit_batch(parse_layout(name), 4, 8)) for name in ("fsdp2", "tp2", "fsdp2xtp2")}
    # float8 all-gather (an execution key: the same float8 values) with the local-shard scale defect
    out.env = {**env, "QUADRA_TEST_DEFECT": "float8_local_amax:*"}
    layout = fit_batch(parse_layout("fsdp2"), 4, 8)
    defect = ParityLayout("fsdp2_local_amax", 2, {**layout.overrides, "float8.fsdp_all_gather": "true"})
    rows["defect"] = out.compare(defect)
    return out, rows


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2xtp2"])
def test_float8_layout_passes_against_the_noise_floor(sweep, layout):
    out, rows = sweep
    row = rows[layout]
    assert row["passed"], format_table([row], "float32", out)
    assert row["reference_microbatch"] == 4 and list(out.references) == [4]
    reference = out.references[4]
    assert row["floor"] == reference.floor[-1] > 0 and reference.parameter_floor > 0
    assert set(reference.twins) == {"reordered sequences", "other CPU kernels"}


def test_the_fixed_fp32_tolerance_would_fail_float8(sweep):
    """Why the floor: float8's final parameters differ beyond the fp32 tolerance in a correct layout."""
    _, rows = sweep
    assert max(rows[name]["params"] for name in ("fsdp2", "tp2", "fsdp2xtp2")) > TOLERANCES["float32"][1]


def test_a_scale_from_one_fsdp_shard_fails_at_step_1(sweep):
    out, rows = sweep
    row = rows["defect"]
    assert not row["error"], row["error"]
    assert not row["passed"] and row["first_failing_step"] == 1, format_table([row], "float32", out)
    assert "floor (steps / params)" in format_table([row], "float32", out)

