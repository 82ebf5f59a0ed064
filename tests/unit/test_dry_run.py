"""``./run_train.sh --dry_run`` (engine/launch/dry_run.py through engine/launch/launcher.py): bad layouts fail with one
line; a layout that does not fit exits 1 with a hint. The docs' dry runs (engine/docs/choosing-a-layout.md and models.md: 405B on 512 ranks building its real plan
in one process without a GPU, the DeepSeek-V3 671B and Llama 3 8B layouts) run as written in
tests/integration/test_doc_commands.py."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.training_utils import REPO


def _launch(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    return subprocess.run([sys.executable, "-m", "engine.launch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_refuses_a_bad_layout_in_one_line():
    result = _launch("--job.config_file", "train_configs/debug_model.toml", "--dry_run", "--parallelism.tp", "3",
                     NGPU="6")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallelism.tp" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_fit_warning_names_the_predicted_bytes():
    """The launcher's GPU pre-flight warning (engine/launch/dry_run.py ``fit_message``): the 8B preset on one
    80 GiB GPU cannot hold its 120 GiB of state; the debug model can."""
    from engine.config import load_config
    from engine.launch.dry_run import fit_message
    from engine.observe.hardware import GIB, get_gpu

    gpu = get_gpu("H100-80GB")
    big = load_config(["--job.config_file", os.path.join(REPO, "train_configs", "llama3_8b.toml")])
    message = fit_message(big, 1, gpus_per_node=1, gpu=gpu, gpu_bytes=80 * GIB, gpu_name="NVIDIA H100 80GB HBM3")
    assert message and "optimizer 59.8" in message and "has 80.0 GiB" in message, message
    small = load_config(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")])
    assert fit_message(small, 2, gpus_per_node=2, gpu=gpu, gpu_bytes=80 * GIB, gpu_name="x") is None


def test_dry_run_that_does_not_fit_exits_1_with_a_hint():
    result = _launch("--job.config_file", "train_configs/llama3_8b.toml", "--dry_run", NGPU="1")
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    last = result.stdout.strip().splitlines()[-2:]
    # 8B on one GPU: 119.6 GiB of state alone; sharding it is the fix, not activation settings.
    assert last[0].startswith("dry run: does NOT fit") and "shard them over more GPUs" in last[1], last
    from engine.launch.dry_run import fit_hint
    from engine.observe.hardware import GIB
    from engine.planner.memory import MemoryEstimate

    # State that fits with activations that do not: the activation settings are the fix.
    hint = fit_hint(MemoryEstimate(4 * GIB, 4 * GIB, 8 * GIB, 200 * GIB, 0), 80 * GIB)
    assert hint.startswith('try activation_checkpoint.mode = "full"'), hint


def test_a_layout_fits_only_within_the_headroom():
    """5 % of the GPU stays free (engine/observe/hardware.py HEADROOM): a total at 97 % of the memory
    is reported as not fitting, one at 94 % fits."""
    from engine.config import load_config
    from engine.launch.dry_run import fit_message
    from engine.planner.estimate import estimate
    from engine.observe.hardware import get_gpu
    from engine.planner.layout import Layout

    gpu = get_gpu("H100-80GB")
    cfg = load_config(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")])
    total = estimate(Layout.from_config(cfg, 2, "cuda"), gpu, 2).memory.total
    assert fit_message(cfg, 2, gpus_per_node=2, gpu=gpu, gpu_bytes=int(total / 0.97), gpu_name="x")
    assert fit_message(cfg, 2, gpus_per_node=2, gpu=gpu, gpu_bytes=int(total / 0.94), gpu_name="x") is None
