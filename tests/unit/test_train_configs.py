"""The shipped train_configs/*.toml: each loads and validates, the debug config spells out every key,
and the LLaMA-3 presets carry the settings their GPU counts assume."""

import math
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

from engine.config import CONFIG_KEYS, load_config

REPO = Path(__file__).resolve().parents[2]
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


# Peak learning rates and the 8K pretraining context from the Llama 3 paper (Dubey et al. 2024,
# arXiv 2407.21783, Table 3 and §3.4.1): 8B 3e-4, 70B 1.5e-4, 405B 8e-5.
@pytest.mark.parametrize("name,flavor,lr", [
    ("llama3_8b.toml", "8B", 3e-4),
    ("llama3_70b.toml", "70B", 1.5e-4),
    ("llama3_405b.toml", "405B", 8e-5),
])
def test_llama3_presets_follow_the_paper(name, flavor, lr):
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / name)])
    assert (cfg.model.flavor, cfg.optimizer.lr, cfg.training.seq_len) == (flavor, lr, 8192)
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.model.vocab_size == -1


GPUS_PER_NODE = 8


@pytest.mark.parametrize("path", [p for p in PRESETS if not p.name.startswith("debug")], ids=lambda p: p.name)
def test_preset_is_valid_for_the_gpus_it_states(path):
    """The header's "Assumes N GPUs" passes the launcher's own pre-flight at world size N on CUDA
    (degrees, batch divisibility, heads and vocabulary vs tp, pipeline stages, experts vs ep), and
    tensor parallel stays inside one 8-GPU node (its all-reduces need NVLink)."""
    from engine.setup.preflight import check_setup

    match = re.search(r"Assumes (\d+) GPUs", path.read_text())
    assert match, f"{path.name}: the first lines must say 'Assumes N GPUs'"
    world_size = int(match.group(1))
    cfg = load_config(["--job.config_file", str(path)])
    plan = check_setup(cfg, world_size, "cuda", check_data=False)
    dims = plan.parallel_dims
    assert dims.tp * dims.cp <= GPUS_PER_NODE and GPUS_PER_NODE % dims.tp == 0
    assert dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp == world_size
