"""Tests for JobConfig.validate() (engine/config/validation.py): the range rules, each refused with the
setting, its value and the fix, all problems reported at once; edge values accepted."""

import pytest

from engine.config import ConfigError, JobConfig


def _invalid(**overrides) -> str:
    """validate() on a default config with ``section__key=value`` overrides -> error message."""
    cfg = JobConfig()
    for name, value in overrides.items():
        section, key = name.split("__")
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    return str(info.value)


@pytest.mark.parametrize("overrides,fragments", [
    (dict(training__steps=0), ("training.steps = 0", "> 0")),
    (dict(optimizer__lr=0.0), ("optimizer.lr = 0.0", "> 0")),
    (dict(optimizer__lr=-1e-3, lr_scheduler__min_lr=0.0), ("optimizer.lr = -0.001",)),
    (dict(training__local_batch_size=0), ("training.local_batch_size = 0", "> 0")),
    (dict(training__seq_len=-5), ("training.seq_len = -5", "> 0")),
    (dict(training__global_batch_size=0), ("training.global_batch_size = 0", "-1")),
    (dict(training__global_batch_size=-2), ("training.global_batch_size = -2", "-1")),
    (dict(training__global_batch_size=12), ("training.global_batch_size = 12", "multiple")),
    (dict(lr_scheduler__warmup_steps=-1), ("lr_scheduler.warmup_steps = -1", ">= 0")),
    (dict(lr_scheduler__min_lr=-1e-5), ("lr_scheduler.min_lr = -1e-05", ">= 0")),
    (dict(lr_scheduler__min_lr=1e-2), ("lr_scheduler.min_lr = 0.01", "optimizer.lr")),
    (dict(lr_scheduler__decay_ratio=1.5), ("lr_scheduler.decay_ratio = 1.5", "[0, 1]")),
    (dict(lr_scheduler__decay_ratio=-0.1), ("lr_scheduler.decay_ratio = -0.1", "[0, 1]")),
    (dict(parallelism__dp_shard=0), ("parallelism.dp_shard = 0", "-1")),
    (dict(parallelism__dp_shard=-2), ("parallelism.dp_shard = -2", "-1")),
    (dict(parallelism__dp_replicate=0), ("parallelism.dp_replicate = 0", ">= 1")),
    (dict(parallelism__cp=0), ("parallelism.cp = 0", ">= 1")),
    (dict(parallelism__tp=-1), ("parallelism.tp = -1", ">= 1")),
    (dict(parallelism__pp=0), ("parallelism.pp = 0", ">= 1")),
    (dict(parallelism__ep=0), ("parallelism.ep = 0", ">= 1")),
    (dict(profiling__enable=True, profiling__start_step=0), ("profiling.start_step = 0", ">= 1")),
    (dict(profiling__enable=True, profiling__num_steps=0), ("profiling.num_steps = 0", ">= 1")),
    (dict(parallelism__pp=2, parallelism__grad_sync_each_microbatch=False),
     ("parallelism.grad_sync_each_microbatch = false", "pp > 1", "leave it true")),
    (dict(metrics__log_freq=0), ("metrics.log_freq = 0", "> 0")),
    (dict(validation__enable=True, validation__freq=0), ("validation.freq = 0", "validation.enable")),
    (dict(validation__steps=0), ("validation.steps = 0", "-1")),
    (dict(validation__steps=-3), ("validation.steps = -3", "-1")),
    (dict(activation_checkpoint__selective_ac_option="blocks"),
     ('selective_ac_option = "blocks"', '"op"', '"op_all_matmuls"', "positive integer")),
    (dict(activation_checkpoint__selective_ac_option="0"),
     ('selective_ac_option = "0"', "positive integer")),
    (dict(checkpoint__interval=0), ("checkpoint.interval = 0", "> 0")),
    (dict(checkpoint__keep_latest_k=-1), ("checkpoint.keep_latest_k = -1", ">= 0")),
    (dict(checkpoint__enable=True, checkpoint__load_step=-2), ("checkpoint.load_step = -2", "-1")),
    (dict(checkpoint__enable=True, checkpoint__folder=""), ('checkpoint.folder = ""', "must name a folder")),
    (dict(checkpoint__load_step=5), ("checkpoint.load_step = 5", "checkpoint.enable = true")),
    (dict(checkpoint__initial_load_path="x"), ('checkpoint.initial_load_path = "x"', "checkpoint.enable = true")),
    (dict(checkpoint__enable=True, checkpoint__initial_load_path="x", checkpoint__initial_load_lr="restart"),
     ('checkpoint.initial_load_lr = "restart"', "full load only", "initial_load_model_only = false")),
    (dict(checkpoint__initial_load_data="restart"), ('checkpoint.initial_load_data = "restart"', "full load only")),
    (dict(checkpoint__async_mode="sometimes"), ("checkpoint.async_mode", "disabled|async")),
    (dict(lr_scheduler__decay_type="cos"), ("lr_scheduler.decay_type", "cosine")),
    (dict(training__steps="10"), ("training.steps", '"10"', "expected an int")),
    (dict(activation_checkpoint__selective_ac_option=2), ("selective_ac_option", "'2'")),
    (dict(loss__chunk_tokens=-1), ("loss.chunk_tokens = -1", ">= 0", "0: the unfused loss")),
    (dict(record__step=-1), ("record.step = -1", ">= 0")),
    (dict(record__step=2, record__folder=" "), ('record.folder = " "', "must name a folder")),
    (dict(record__step=2, compile__enable=True), ("compile.enable = true", "record.step", "compile.enable = false")),
])
def test_validate_rejects(overrides, fragments):
    message = _invalid(**overrides)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_validate_accepts_edge_values():
    cfg = JobConfig()
    cfg.validation.freq = 0               # ignored while validation is disabled
    cfg.validation.steps = -1
    cfg.training.global_batch_size = 16
    cfg.lr_scheduler.min_lr = cfg.optimizer.lr
    cfg.lr_scheduler.decay_ratio = 1.0
    cfg.lr_scheduler.warmup_steps = 0
    cfg.parallelism.dp_shard = 4
    cfg.activation_checkpoint.selective_ac_option = "3"
    cfg.training.max_norm = 0.0           # <= 0 disables clipping, not an error
    cfg.loss.chunk_tokens = 0             # the unfused loss
    cfg.validate()
    for option in ("op", "op_all_matmuls"):  # the two per-op policies
        cfg.activation_checkpoint.selective_ac_option = option
        cfg.validate()


def test_validate_reports_all_problems_at_once():
    message = _invalid(training__steps=0, optimizer__lr=-1.0, metrics__log_freq=0)
    assert "training.steps" in message and "optimizer.lr" in message and "metrics.log_freq" in message


def test_a_record_step_after_the_last_step_is_warned_about():
    from engine.config import load_config

    assert any("record.step = 9" in w and "nothing will be recorded" in w
               for w in load_config(["--training.steps", "5", "--record.step", "9"]).warnings())
    assert not any("record.step" in w for w in load_config(["--training.steps", "5", "--record.step", "5"]).warnings())
