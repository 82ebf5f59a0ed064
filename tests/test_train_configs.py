"""The shipped train_configs/*.toml: each loads and validates, the debug config spells out every key,
and the LLaMA-3 presets carry the settings their GPU counts assume."""

import math
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

from engine.config import CONFIG_KEYS, load_config

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted((REPO / "train_configs").glob("*.toml"))


def test_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"debug_model.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_validates(path):
    cfg = load_config(["--job.config_file", str(path)])
    cfg.validate()
    assert cfg.run_folder == str(Path("outputs") / path.stem)
    # Every preset checkpoints, so a preempted or killed run resumes with the same command.
    assert cfg.checkpoint.enable is True and cfg.checkpoint.interval > 0 and math.isfinite(cfg.optimizer.lr)


def test_debug_model_spells_out_every_key():
    data = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    keys = {f"{s}.{k}" for s, t in data.items() for k in t}
    assert keys == set(CONFIG_KEYS) - {"job.config_file"}
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")])
    t, s, v = cfg.training, cfg.lr_scheduler, cfg.validation
    assert (cfg.model.flavor, t.steps, t.local_batch_size, t.seq_len) == ("debugmodel", 100, 4, 256)
    assert (cfg.optimizer.lr, s.warmup_steps, s.decay_type, s.min_lr) == (8e-4, 10, "cosine", 8e-5)
    assert (v.enable, v.freq, v.steps, cfg.metrics.log_freq) == (True, 50, 5, 10)
    assert cfg.parallelism.dp_shard == -1


@pytest.mark.parametrize("name,flavor,tp,lr,ac", [
    ("llama3_8b.toml", "8B", 1, 3e-4, "selective"),
    ("llama3_70b.toml", "70B", 8, 1.5e-4, "full"),
    ("llama3_405b.toml", "405B", 8, 8e-5, "full"),
])
def test_llama3_presets(name, flavor, tp, lr, ac):
    path = REPO / "train_configs" / name
    cfg = load_config(["--job.config_file", str(path)])
    assert (cfg.model.flavor, cfg.parallelism.tp, cfg.optimizer.lr) == (flavor, tp, lr)
    assert cfg.activation_checkpoint.mode == ac and cfg.parallelism.dp_shard == -1
    assert cfg.training.seq_len == 8192 and cfg.parallelism.pp == 1
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.validation.enable is False
    assert cfg.model.vocab_size == -1
    head = path.read_text().splitlines()[0]
    assert "GPUs" in head
