"""Weights & Biases ([metrics] enable_wandb, engine/observe/sinks.py) in offline mode: a job is one W&B
run across restarts (one before the first save included), SIGTERM resumes and layout changes, and the
history its offline folders leave holds each step once with the keys of metrics.jsonl (an attempt that
trains steps again rewinds the run first); the config names it; without the wandb package, or without
W&B credentials where the mode needs them, the pre-flight refuses in one line."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine.testing.processes import run_distributed
from tests.extras import require_extra
from tests.integration.test_launch import _finish, _launch
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


def _train_until_sigterm(argv: list[str], step: int) -> tuple:
    """Train as ``train_to_end`` does, but SIGTERM this process once step ``step`` is trained (as scancel
    or a container runtime would): the run stops there and saves; and again as it starts closing its
    metrics (as torchrun stops the survivors of a failed rank): W&B's run must still be written whole
    (the trainer restored the default handler first: that SIGTERM killed it with W&B's records unwritten).
    -> (stopped_by, stop_saved, step)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    train_step, close_metrics = trainer.train_step, trainer.metrics.close

    def step_then_signal() -> dict:
        record = train_step()
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    def signal_then_close() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        close_metrics()

    trainer.train_step, trainer.metrics.close = step_then_signal, signal_then_close
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.stopped_by, trainer.stop_saved, trainer.step


def _offline(tmp_path, monkeypatch) -> None:
    """W&B offline, silent, with its settings and caches in ``tmp_path`` (the launched ranks inherit them)."""
    require_extra("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _segments(run) -> list[dict]:
    """The offline-run folders of the run folder ``run`` in the order they started (``wandb sync``
    uploads one run's folders in that order), each as {"id", "run": (id, name, tags), "rewind": the
    step its run record rewinds the run to (``resume_from``) or None, "history": {step: {key: value}}}."""
    segments = []
    for folder in glob.glob(str(run / "wandb" / "offline-run-*")):
        # offline-run-<date>_<time>-<run id>; W&B appends "-1" to a second folder of the same second.
        segment = {"id": re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", os.path.basename(folder)).group(1),
                   "history": {}}
        (log,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        for record in read_wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                segment["run"] = (r.run_id, r.display_name, list(r.tags))
                segment["start"] = r.start_time.ToNanoseconds()
                rewinds = r.HasField("branch_point") and r.branch_point.run == r.run_id
                segment["rewind"] = int(r.branch_point.value) if rewinds else None
            elif kind == "history":
                step = record.history.step.num
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                assert step not in segment["history"], f"step {step} logged twice in {folder}"
                segment["history"][step] = {k: v for k, v in items.items() if not k.startswith("_")}  # W&B's own
        assert "run" in segment, f"{folder} holds no run record: its attempt ended before W&B wrote it"
        segments.append(segment)
    return sorted(segments, key=lambda segment: segment["start"])


def _run_history(segments: list[dict]) -> dict[int, dict]:
    """{step: {key: value}} of the one W&B run the segments make: each rewind drops the history after its
    step first, as W&B's run rewind does. Fails where a segment logs a step the run already holds."""
    history: dict[int, dict] = {}
    for segment in segments:
        if segment["rewind"] is not None:
            history = {step: values for step, values in history.items() if step <= segment["rewind"]}
        for step, values in sorted(segment["history"].items()):
            assert step not in history, f"step {step} is recorded twice in the W&B run"
            history[step] = values
    return history


def _metrics(run, kinds=("train", "validation", "eval", "goodput")) -> dict[int, dict]:
    """{step: {"<kind>/<key>": value}} of metrics.jsonl's numeric values, as W&B gets them (the
    "attempt" records of a launch's ledger name earlier steps: W&B puts them in the run's summary)."""
    want: dict[int, dict] = {}
    with open(run / "metrics.jsonl") as file:
        for record in map(json.loads, file):
            if record["kind"] in kinds:
                want.setdefault(record["step"], {}).update(
                    {f"{record['kind']}/{key}": value for key, value in record.items() if key not in ("step", "kind")
                     and isinstance(value, (int, float)) and not isinstance(value, bool)})
    return want


def test_the_job_run_id_is_the_checkpoints_else_the_run_folders_else_a_fresh_one(tmp_path):
    require_extra("wandb")
    from engine.observe.sinks import RUN_ID_FILE, job_run_id, read_run_id

    folder, rank0 = str(tmp_path / "run"), SimpleNamespace(rank=0, is_distributed=False)
    path = os.path.join(folder, RUN_ID_FILE)
    first = job_run_id(None, folder, rank0)  # the job's first attempt: a fresh id, kept in the run folder
    assert re.fullmatch(r"[a-z0-9]{8}", first) and read_run_id(path) == first
    assert job_run_id(None, folder, rank0) == first  # a restart before the first save: the same run
    assert job_run_id("fromckpt", folder, rank0) == "fromckpt"  # the checkpoint being resumed wins,
    assert read_run_id(path) == "fromckpt"  # and later attempts follow it
    assert os.listdir(folder) == [RUN_ID_FILE]  # written through a temporary file, none left


def test_the_sink_rewinds_only_a_run_it_wrote_and_continues_where_the_server_refuses(tmp_path, monkeypatch,
                                                                                     caplog):
    """WandbSink's choice of ``wandb.init`` arguments (W&B's init replaced: no service, no server): a step
    trained again rewinds the run when the run folder holds a segment of it; the server's refusal of the
    rewind (online, without the preview feature: a CommError) is a warning and a plain resume."""
    require_extra("wandb")
    import wandb

    from engine.observe.sinks import WandbSink

    calls = []

    def init(**kwargs):
        calls.append({key: kwargs.get(key) for key in ("id", "resume", "resume_from")})
        if kwargs.get("resume_from") and refuse:
            raise wandb.errors.CommError("failed to rewind run: rewinding is not enabled")
        return SimpleNamespace()

    monkeypatch.setattr(wandb, "init", init)
    cfg = SimpleNamespace(wandb_project="p", wandb_entity="", wandb_run_name="", wandb_tags=[])
    refuse = False
    WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=4)  # nothing of this run here: nothing to rewind
    (tmp_path / "wandb" / "offline-run-20260101_000000-abcd1234").mkdir(parents=True)
    WandbSink(cfg, str(tmp_path), "abcd1234", {})  # no step trained again
    WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=4)
    refuse = True
    WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=0)
    plain = {"id": "abcd1234", "resume": "allow", "resume_from": None}
    assert calls == [plain, plain, {"id": "abcd1234", "resume": None, "resume_from": "abcd1234?_step=4"},
                     {"id": "abcd1234", "resume": None, "resume_from": "abcd1234?_step=0"}, plain]
    assert "refused to rewind run abcd1234 to step 0 (failed to rewind run: rewinding is not enabled)" in caplog.text


def test_restarts_before_and_after_the_first_save_continue_one_wandb_run(tmp_path, monkeypatch):
    """Issue #48 item 4: MAX_RESTARTS=2, rank 1 SIGKILLed at the start of step 3 (no checkpoint yet:
    interval 4), then, in the restarted attempt, at the start of step 6 (checkpoint step-4). Each attempt
    writes an offline-run folder, all three of ONE run (the first restart drew a new id before), with
    the id of <run folder>/wandb_run_id; the second attempt rewinds the run to step 0, the third to step
    4, so the history they leave holds steps 1-6 once each, with metrics.jsonl's values."""
    _offline(tmp_path, monkeypatch)
    run = tmp_path / "run"
    args = base_args(str(run), {"training.steps": 6, "training.local_batch_size": 4, "validation.enable": "false",
                                "checkpoint.enable": True, "checkpoint.interval": 4, "metrics.enable_wandb": True})
    proc = _launch(args, MAX_RESTARTS="2", QUADRA_TEST_FAULT="kill:1:3,kill:1:6@1", LOG_RANKS="0")
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("quadra: restart") == 2, out[-3000:]
    segments = _segments(run)
    ids = [segment["id"] for segment in segments]
    assert len(ids) == 3 and len(set(ids)) == 1, ids  # one W&B run, one folder per attempt
    assert (run / "wandb_run_id").read_text() == ids[0] + "\n"
    assert _run_history(segments) == _metrics(run)  # steps 1-6 once each: the rewinds drop what is trained again
    assert [segment["rewind"] for segment in segments] == [None, 0, 4]
    assert [sorted(segment["history"]) for segment in segments] == [[1, 2], [1, 2, 3, 4, 5], [5, 6]]


def test_a_sigterm_resume_on_another_layout_is_one_wandb_run_with_the_metrics(tmp_path, monkeypatch):
    """One process SIGTERMed after step 3 (it saves step-3), then two ranks (dp_shard 2) resume it in
    the same folder to step 6: one W&B run (the checkpoint's id, also the run folder's), named and
    tagged as configured, no rewind (no step is trained again), steps 1-6 once each with metrics.jsonl's
    train, validation and eval values."""
    _offline(tmp_path, monkeypatch)
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "KING.", "choices": ["My lord", "xq"], "gold": 0}) + "\n")
    run = tmp_path / "run"
    args = base_args(str(run), {"training.steps": 6, "training.local_batch_size": 4, "checkpoint.enable": True,
                                "checkpoint.interval": 4, "metrics.enable_wandb": True,
                                "metrics.wandb_run_name": "resumed-run", "metrics.wandb_tags": "cpu,test",
                                "validation.freq": 2, "eval.enable": True, "eval.tasks": str(task), "eval.freq": 3})
    assert run_distributed(_train_until_sigterm, 1, args, 3, torchrun_env=False) == [("SIGTERM", True, 3)]
    run_distributed(_train, 2, args)

    segments = _segments(run)
    run_id = segments[0]["id"]
    assert [segment["run"] for segment in segments] == [(run_id, "resumed-run", ["cpu", "test"])] * 2, segments
    assert (run / "wandb_run_id").read_text() == run_id + "\n"
    assert [segment["rewind"] for segment in segments] == [None, None]
    history, want = _run_history(segments), _metrics(run)
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert {"train/loss", "validation/loss", "eval/task/acc", "eval/task/acc_norm"} <= set(want[6])
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
