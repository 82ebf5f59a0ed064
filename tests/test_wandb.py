"""Weights & Biases ([metrics] enable_wandb, engine/observe/sinks.py) in offline mode: a run stopped
after step 3 and resumed to step 6 is one W&B run (the id travels in the checkpoint) whose history
holds steps 1-6 once each, with the keys of metrics.jsonl; the config names it; without the wandb
package, or without W&B credentials where the mode needs them, the pre-flight refuses in one line."""

from __future__ import annotations

import glob
import json
import os
import re
import struct
import subprocess
import sys

import pytest

from tests.dist_utils import run_distributed
from tests.extras import require_extra
from tests.training_utils import REPO, base_args, train_to_end

BLOCK = 32768  # the LevelDB log format of the .wandb transaction log: 32 KiB blocks
HEADER = 7  # ":W&B", 2 magic bytes, a version byte; then records of crc (4), length (2), type (1)


def read_wandb_records(path: str) -> list:
    """Every ``wandb_internal_pb2.Record`` of an offline run's ``run-<id>.wandb`` file, parsed with
    wandb's own protobuf classes (its Python reader of the log framing is gone from wandb 0.31)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    records, pos, chunks = [], HEADER, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
        elif kind == 0:
            break
    return records


_train = train_to_end  # (tests/training_utils.py)


def _numeric_keys(record: dict) -> set[str]:
    return {f"{record['kind']}/{key}" for key, value in record.items()
            if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool)}


@pytest.mark.slow  # two launches, each starting W&B's service process (~4 s)
def test_offline_run_stopped_and_resumed_is_one_run_with_the_metrics(tmp_path, monkeypatch):
    require_extra("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "KING.", "choices": ["My lord", "xq"], "gold": 0}) + "\n")
    run = tmp_path / "run"
    overrides = {"training.steps": 6, "checkpoint.enable": True, "checkpoint.interval": 3,
                 "metrics.enable_wandb": True, "metrics.wandb_run_name": "resumed-run",
                 "metrics.wandb_tags": "cpu,test", "validation.freq": 2,
                 "eval.enable": True, "eval.tasks": str(task), "eval.freq": 3}
    run_distributed(_train, 1, base_args(str(run), {**overrides, "training.stop_after_step": 3}), torchrun_env=False)
    run_distributed(_train, 1, base_args(str(run), overrides), torchrun_env=False)

    folders = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert len(folders) == 2, folders  # one per launch, of the same run:
    # offline-run-<date>_<time>-<run id>; W&B appends "-1" to a second folder of the same second.
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", os.path.basename(folder)).group(1) for folder in folders}
    assert len(ids) == 1, ids
    history: dict[int, set[str]] = {}
    runs = []
    for folder in folders:
        (log,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        for record in read_wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append((record.run.run_id, record.run.display_name, list(record.run.tags)))
            elif kind == "history":
                step = record.history.step.num
                keys = {item.key or "/".join(item.nested_key) for item in record.history.item}
                keys = {k for k in keys if not k.startswith("_")}  # W&B's own (_step, _runtime, _timestamp)
                assert step not in history, f"step {step} logged twice"
                history[step] = keys
    assert runs and all(r == (next(iter(ids)), "resumed-run", ["cpu", "test"]) for r in runs), runs
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    want: dict[int, set[str]] = {}
    with open(run / "metrics.jsonl") as file:
        for line in file:
            record = json.loads(line)
            if record["kind"] in ("train", "validation", "eval"):
                want.setdefault(record["step"], set()).update(_numeric_keys(record))
    assert {"train/loss", "validation/loss", "eval/task/acc", "eval/task/acc_norm"} <= want[6]
    assert history == want


def test_enable_wandb_without_wandb_is_refused_at_preflight(tmp_path, monkeypatch):
    import importlib.util

    from engine.config import load_config
    from engine.setup.preflight import check_setup

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(base_args(str(tmp_path), {"metrics.enable_wandb": True}))
    with pytest.raises(ValueError) as error:
        check_setup(cfg, 1, "cpu")
    message = str(error.value)
    assert "metrics.enable_wandb" in message and 'pip install -e ".[wandb]"' in message and "\n" not in message


# Every variable W&B reads credentials, mode or server from (engine/observe/sinks.py).
WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "NETRC")
FIXES = ("metrics.enable_wandb", "`wandb login`", "WANDB_API_KEY", "WANDB_MODE=offline", "WANDB_MODE=disabled")


def _no_wandb_credentials(tmp_path, monkeypatch) -> None:
    """A HOME with no .netrc and no W&B settings, and none of :data:`WANDB_ENV`: the machine's own
    login cannot leak in."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)


def _netrc(path, host: str) -> None:
    path.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")  # wandb wants 40+ characters
    path.chmod(0o600)


def test_enable_wandb_without_credentials_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """Issue #54: W&B online with no API key and no netrc entry used to train step 1 and then stop
    ("metrics after step 1 failed (UsageError: No API key configured...)"). The launcher refuses it
    in one line, with status 2, before any rank starts."""
    require_extra("wandb")
    _no_wandb_credentials(tmp_path, monkeypatch)
    monkeypatch.setenv("NGPU", "1")  # one CPU process: the rest of the pre-flight accepts this config
    run = tmp_path / "run"
    out = subprocess.run([os.path.join(REPO, "run_train.sh"), *base_args(str(run), {"metrics.enable_wandb": True})],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("set-up error: metrics.enable_wandb = true but W&B has no credentials"), lines[0]
    assert all(fix in lines[0] for fix in FIXES), lines[0]
    assert not os.path.exists(run)  # no rank started, nothing trained


@pytest.mark.parametrize("env, netrc_host, refused", [
    ({}, None, True),
    ({"WANDB_MODE": "offline"}, None, False),
    ({"WANDB_MODE": "dryrun"}, None, False),
    ({"WANDB_MODE": "disabled"}, None, False),
    ({"WANDB_MODE": "online"}, None, True),
    ({"WANDB_API_KEY": "k" * 40}, None, False),
    ({"WANDB_API_KEY": ""}, None, True),  # empty is unset
    # `wandb login` writes the key into ~/.netrc under the server's host; WANDB_BASE_URL names the server.
    ({"WANDB_BASE_URL": "https://api.wandb.ai"}, "api.wandb.ai", False),
    ({"WANDB_BASE_URL": "https://wandb.example.com"}, "wandb.example.com", False),
    ({"WANDB_BASE_URL": "https://wandb.example.com"}, "api.wandb.ai", True),  # a key for another server
    ({"WANDB_BASE_URL": "https://wandb.example.com", "NETRC": "{tmp}/netrc"}, "wandb.example.com", False),
])
def test_the_preflight_refuses_wandb_only_without_credentials(tmp_path, monkeypatch, env, netrc_host, refused):
    require_extra("wandb")
    from engine.config import load_config
    from engine.setup.preflight import check_setup

    _no_wandb_credentials(tmp_path, monkeypatch)
    env = {name: value.replace("{tmp}", str(tmp_path)) for name, value in env.items()}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if netrc_host:
        _netrc(tmp_path / "netrc" if "NETRC" in env else tmp_path / "home" / ".netrc", netrc_host)
    cfg = load_config(base_args(str(tmp_path / "run"), {"metrics.enable_wandb": True}))
    if not refused:
        check_setup(cfg, 1, "cpu", check_data=False)
        return
    with pytest.raises(ValueError) as error:
        check_setup(cfg, 1, "cpu", check_data=False)
    message = str(error.value)
    assert "\n" not in message and all(fix in message for fix in FIXES), message
    assert (env.get("WANDB_BASE_URL") or "://") in message, message  # names the server it has no key for


def test_the_preflight_imports_no_wandb_when_it_is_off():
    """wandb's settings take ~0.5 s to import: only a run with metrics.enable_wandb pays for them."""
    code = ("import sys\n"
            "from engine.config import load_config\n"
            "from engine.setup.preflight import check_setup\n"
            "check_setup(load_config(['--metrics.enable_wandb', 'false']), 1, 'cpu', check_data=False)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'wandb'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
