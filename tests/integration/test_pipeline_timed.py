"""The timed test of tests/integration/test_pipeline.py: validation through the pipeline equals one
process, and the measured 1F1B bubble is the timetable's. A file of its own because it is marked
``timing``: it runs while the other xdist worker waits (tests/conftest.py), and the files that hold such a
test run after all the others, where no long test of the other worker is left to wait for."""

from __future__ import annotations

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import SMALL_CORPUS, base_args


def _train_with_validation(argv):
    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    history = trainer.train()
    val_loss = trainer.validate()
    trainer.close()
    return val_loss, [h.get("pp_bubble_fraction") for h in history]


@pytest.mark.timing
def test_validation_and_bubble_through_the_pipeline(tmp_path):
    # debugmodel, not the suite's tiny flavor: microbatches long enough for the bubble to be timed
    val_args = {"validation.enable": "true", "validation.path": SMALL_CORPUS, "validation.steps": 2,
                "model.flavor": "debugmodel"}
    single = run_distributed(_train_with_validation, 1, base_args(str(tmp_path / "a"), val_args), torchrun_env=False)
    pipelined = run_distributed(
        _train_with_validation, 2, base_args(str(tmp_path / "b"), {**val_args, "parallelism.pp": 2})
    )
    reference_loss, no_bubble = single[0]
    assert no_bubble == [None] * len(no_bubble)
    # 1F1B over K = 2 stages and M = 8 microbatches idles (K-1)/(M+K-1) of a step with equal stages
    # (Narayanan et al. arXiv 2006.09503). Stages are not equal here (the output head is the heavier
    # end), so one rank idles more and the other less; a timer that counted waiting as work (~0) or
    # work as waiting (~1) is far outside these bounds. Step 1 (warm-up) is left out.
    timetable = (2 - 1) / (8 + 2 - 1)
    for val_loss, bubbles in pipelined:
        assert abs(val_loss - reference_loss) / reference_loss < 1e-5
        typical = sorted(bubbles[1:])[len(bubbles[1:]) // 2]
        assert 0.4 * timetable <= typical <= 0.6, (bubbles, timetable)
