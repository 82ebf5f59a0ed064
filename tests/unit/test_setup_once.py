"""The set-up each process needs is resolved once per process: the tokenizer is loaded once and the
pipeline planned once, whether the process is a rank (Trainer), the launcher's dry run (pre-flight,
the planner's layout and two real plans) or the seed-checkpoint tool."""

from __future__ import annotations

import pytest

import engine.data.tokenizer as tokenizer_module
import parallelisms.pipeline_plan as pipeline_plan_module
from engine.config import load_config
from tests.training_utils import base_args


@pytest.fixture
def calls(monkeypatch):
    """Counts of Tokenizer loads and pipeline plannings in this process."""
    counts = {"tokenizer": 0, "pipeline": 0}
    real_init, real_plan = tokenizer_module.Tokenizer.__init__, pipeline_plan_module.plan_pipeline

    def init(self, *args, **kwargs):
        counts["tokenizer"] += 1
        real_init(self, *args, **kwargs)

    def plan(*args, **kwargs):
        counts["pipeline"] += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module.Tokenizer, "__init__", init)
    monkeypatch.setattr(pipeline_plan_module, "plan_pipeline", plan)
    return counts


def test_dry_run_with_pipeline_resolves_once(tmp_path, calls, capsys):
    from engine.launch.dry_run import dry_run

    cfg = load_config(base_args(str(tmp_path), {"parallelism.pp": "2", "parallelism.dp_shard": "2",
                                                "training.local_batch_size": "4", "parallelism.pp_microbatch_size": "2"}))
    cfg.validate()
    assert dry_run(cfg, 4, gpus_per_node=4) in (0, 1), capsys.readouterr()
    out = capsys.readouterr().out
    assert "real plan of rank 2" in out  # the last stage's rank was built too
    assert calls == {"tokenizer": 1, "pipeline": 1}


def test_trainer_resolves_once(tmp_path, calls):
    from engine.train.trainer import Trainer

    cfg = load_config(base_args(str(tmp_path), {"checkpoint.enable": "false"}))
    cfg.validate()
    trainer = Trainer(cfg)
    try:
        assert calls["tokenizer"] == 1 and trainer.tokenizer is trainer.setup.tokenizer
    finally:
        trainer.close()


def test_seed_checkpoint_loads_the_tokenizer_once(tmp_path, calls):
    from engine.convert.tools import save_seed_checkpoint

    cfg = load_config(base_args(str(tmp_path), {"checkpoint.enable": "true"}))
    cfg.validate()
    save_seed_checkpoint(cfg)
    assert calls["tokenizer"] == 1
