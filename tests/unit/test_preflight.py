"""The launcher's pre-flight: torch-free start-up rules, launch settings and honest warnings."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from engine.config import load_config
from engine.setup.preflight import check_setup, hardware_warnings
from tests.training_utils import REPO


def test_setup_rules_import_no_torch():
    """The rules of every parallelism, the registry, the flavors and the data-path check run without
    torch, datasets or the model code, which is what makes a refusal take a fraction of a second. (One
    config's path; tests/unit/test_preflight_imports.py reads every branch of the pre-flight statically.)"""
    code = (
        "import sys\n"
        "from engine.config import load_config\n"
        "from engine.setup.preflight import check_setup\n"
        "cfg = load_config(['--parallelism.pp', '2', '--parallelism.cp', '2', '--parallelism.tp', '2',\n"
        "                   '--document_mask.enable', 'true', '--document_mask.restart_positions', 'true'])\n"
        "cfg.validate()\n"
        "plan = check_setup(cfg, 16, 'cpu')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'datasets', 'numpy'))\n"
        "print(plan.parallel_dims.dp_shard, plan.grad_accum_steps, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2 1 []", out.stdout  # 16 = pp 2 × dp_shard 2 × cp 2 × tp 2


def test_check_setup_resolves_the_layout():
    config = os.path.join(REPO, "train_configs", "debug_model.toml")  # local_batch_size 4
    cfg = load_config(["--job.config_file", config, "--training.global_batch_size", "32"])
    cfg.validate()
    plan = check_setup(cfg, 4, "cpu")
    assert (plan.parallel_dims.dp_shard, plan.global_batch_size, plan.grad_accum_steps) == (4, 32, 2)
    assert plan.tokenizer_vocab_size == 4096 and plan.model_args.max_seq_len == cfg.training.seq_len


def test_launch_settings_are_checked_before_torchrun(tmp_path):
    env = {**os.environ, "NNODES": "2", "NGPU": "1"}
    env.pop("MASTER_ADDR", None)
    out = subprocess.run([os.path.join(REPO, "run_train.sh"), "--job.dump_folder", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("launch error: NNODES=2 needs MASTER_ADDR"), out.stderr
    env.update(MASTER_ADDR="127.0.0.1", NODE_RANK="2")
    out = subprocess.run([os.path.join(REPO, "run_train.sh"), "--job.dump_folder", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "NODE_RANK=2 must be below NNODES=2" in out.stderr, out.stderr


def test_a_missing_local_path_that_reads_as_a_hub_name_is_refused_before_any_rank_starts(tmp_path):
    out = subprocess.run([os.path.join(REPO, "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"),
                          "--data.path", "assets/no_such_corpus"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)  # run_train.sh reads paths from the repo root, where ./assets is a folder
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "data.path='assets/no_such_corpus' does not exist, though ./assets is a local folder" in lines[0]
    assert not os.path.exists(tmp_path / "run")  # no rank started


@pytest.mark.parametrize("fast_bf16, device, dtype, warned", [
    (False, "cpu", "bfloat16", True),
    (True, "cpu", "bfloat16", False),  # AVX512-BF16 / AMX: bf16 is fast
    (False, "cuda", "bfloat16", False),
    (False, "cpu", "float32", False),
])
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch, fast_bf16, device, dtype, warned):
    monkeypatch.setattr("engine.setup.preflight.cpu_has_fast_bf16", lambda: fast_bf16)
    cfg = load_config(["--training.mixed_precision_param", dtype])
    warnings = hardware_warnings(cfg, device)
    assert bool(warnings) == warned
    if warned:
        assert "AVX512-BF16 or AMX" in warnings[0] and 'mixed_precision_param = "float32"' in warnings[0]


@pytest.mark.parametrize("fast_bf16, device, ns_dtype, warned", [
    (False, "cpu", "bfloat16", True),
    (True, "cpu", "bfloat16", False),
    (False, "cuda", "bfloat16", False),
    (False, "cpu", "float32", False),
])
def test_muon_bf16_newton_schulz_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch, fast_bf16, device,
                                                                                    ns_dtype, warned):
    monkeypatch.setattr("engine.setup.preflight.cpu_has_fast_bf16", lambda: fast_bf16)
    cfg = load_config(["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", ns_dtype,
                       "--training.mixed_precision_param", "float32"])
    warnings = hardware_warnings(cfg, device)
    assert len(warnings) == int(warned), warnings
    assert not warned or 'set optimizer.muon_ns_dtype = "float32"' in warnings[0]
    assert not hardware_warnings(load_config(["--training.mixed_precision_param", "float32"]), device)  # AdamW


def _unguarded_tomllib_imports(path: str) -> list[int]:
    """Lines that import tomllib outside a ``try`` or ``if`` (Python 3.10 has no tomllib: tomli instead)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    guarded = {id(node) for t in ast.walk(tree) if isinstance(t, (ast.Try, ast.If)) for stmt in t.body
               for node in ast.walk(stmt)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Import)
            and any(a.name == "tomllib" for a in node.names) and id(node) not in guarded]


def test_python_3_10_needs_no_tomllib():
    """pyproject.toml claims Python 3.10: every tomllib import falls back to tomli."""
    bad = {}
    for folder in ("engine", "models", "parallelisms", "scripts", "tests"):
        for root, _, names in os.walk(os.path.join(REPO, folder)):
            for name in names:
                if name.endswith(".py") and (lines := _unguarded_tomllib_imports(os.path.join(root, name))):
                    bad[os.path.relpath(os.path.join(root, name), REPO)] = lines
    assert not bad, f"unguarded 'import tomllib': {bad}"
