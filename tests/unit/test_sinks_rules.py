"""engine/observe/sinks.py's rules without W&B's service (its docstrings): which metrics.jsonl records a
resumed attempt drops, the job's run id on every rank, and what WandbSink hands W&B (keys, steps, the
summary for an earlier step, the run's name). tests/integration/test_wandb.py runs W&B offline for real."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest

from engine.observe.sinks import RUN_ID_FILE, drop_records_from, job_run_id, read_run_id


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_records_from_a_step_on_are_dropped_and_a_torn_line_too(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s} for s in (1, 2, 3, 4)] + [{"kind": "config"}, {"kind": "train", "step": 3}]
    path.write_text(_lines(records) + '{"kind": "train", "st')
    assert drop_records_from(str(path), 3) == [3, 4, 3]
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [records[0], records[1], records[4]]  # a record without a step is step 0
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    assert drop_records_from(str(path), 1) == [1, 2] and path.read_text() == _lines([records[4]])


def test_a_file_with_nothing_to_drop_is_left_as_it_is(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines([{"step": 1}, {"step": 2}]) + '{"step": 3}')  # last line complete, no newline
    before = os.stat(path).st_mtime_ns, path.read_text()
    assert drop_records_from(str(path), 4) == []
    assert (os.stat(path).st_mtime_ns, path.read_text()) == before
    assert drop_records_from(str(path), 3) == [3] and path.read_text() == _lines([{"step": 1}, {"step": 2}])
    path.write_text('{"step": 1}\n{"step": 2}')
    assert drop_records_from(str(path), 2) == [2] and path.read_text() == '{"step": 1}\n'
    path.write_text('{"step": 5}\n{"step": 1}')  # the kept last line gets its newline
    assert drop_records_from(str(path), 3) == [5] and path.read_text() == '{"step": 1}\n'
    path.write_text('{"step": 1}\n{"st\n{"step": 2}\n{"step": 7}\n')  # a torn line inside
    assert drop_records_from(str(path), 7) == [7] and path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # only a torn line: it goes, the rest stays
    assert drop_records_from(str(path), 5) == [] and path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert drop_records_from(str(tmp_path / "none.jsonl"), 0) == [] and not (tmp_path / "none.jsonl").exists()


def test_the_stored_run_id_is_the_files_first_word_or_none(tmp_path):
    path = tmp_path / RUN_ID_FILE
    assert read_run_id(str(path)) is None
    path.write_text("  \n")
    assert read_run_id(str(path)) is None
    path.write_text("abcd1234\n")
    assert read_run_id(str(path)) == "abcd1234"


def test_every_rank_gets_rank_0s_run_id_and_only_rank_0_writes_it(tmp_path, monkeypatch):
    """Without a checkpoint id, rank 0's choice (its file's id, else a fresh one) is broadcast; the
    other ranks read no file (they may not share it) and write none."""
    import torch.distributed as dist

    from engine.observe import sinks

    sent = []

    def broadcast(box, src):
        assert src == 0
        if box[0] is None:
            box[0] = "rank0id1"
        sent.append(box[0])

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(sinks, "new_run_id", lambda: "fresh123")
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    with open(os.path.join(folder, RUN_ID_FILE), "w") as f:
        f.write("stored12\n")
    assert job_run_id(None, folder, SimpleNamespace(rank=1, is_distributed=True)) == "rank0id1"
    assert read_run_id(os.path.join(folder, RUN_ID_FILE)) == "stored12"
    assert job_run_id(None, folder, SimpleNamespace(rank=0, is_distributed=True)) == "stored12"
    assert sent == ["rank0id1", "stored12"]
    assert job_run_id("ckpt1234", folder, SimpleNamespace(rank=1, is_distributed=True)) == "ckpt1234"
    assert len(sent) == 2 and read_run_id(os.path.join(folder, RUN_ID_FILE)) == "stored12"  # no broadcast
    empty = str(tmp_path / "new")
    assert job_run_id(None, empty, SimpleNamespace(rank=0, is_distributed=False)) == "fresh123"
    assert read_run_id(os.path.join(empty, RUN_ID_FILE)) == "fresh123"


class Run:
    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


@pytest.fixture
def sink(tmp_path, monkeypatch):
    """A WandbSink over a recording run (wandb.init replaced: no service); -> (sink, init's kwargs)."""
    wandb = pytest.importorskip("wandb")
    from engine.observe.sinks import WandbSink

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: (calls.append(kwargs), Run())[1])
    cfg = SimpleNamespace(wandb_project="proj", wandb_entity="", wandb_run_name="", wandb_tags=("a", "b"))
    return WandbSink(cfg, str(tmp_path / "my-run"), "abcd1234", {"lr": 1.0}), calls


def test_the_run_is_named_after_the_run_folder_unless_named(sink, tmp_path, monkeypatch):
    made, calls = sink
    assert calls == [dict(project="proj", entity=None, id="abcd1234", dir=str(tmp_path / "my-run"), name="my-run",
                          tags=["a", "b"], config={"lr": 1.0}, resume="allow")]


def test_records_go_to_their_step_as_kind_slash_key_and_an_earlier_step_to_the_summary(sink):
    """Numbers only (not booleans, not the step); a record of an earlier step than the run's goes to
    the summary (W&B steps only increase); the same step again is logged."""
    made, _ = sink
    made.log("validation", {"step": 0, "loss": 9.5})
    made.log("train", {"step": 1, "loss": 2.5, "tokens": 64, "nan": False, "note": "x", "lr": None})
    made.log("train", {"step": 1, "grad_norm": 0.5})
    made.log("train", {"step": 3, "flag": True})  # nothing numeric: nothing logged, the step stays 1
    made.log("attempt", {"step": 0, "wall_s": 12.0})
    made.log("goodput", {"step": 2, "goodput": 0.5})
    assert made.run.logged == [(0, {"validation/loss": 9.5}), (1, {"train/loss": 2.5, "train/tokens": 64}),
                               (1, {"train/grad_norm": 0.5}), (2, {"goodput/goodput": 0.5})]
    assert made.run.summary == {"attempt/wall_s": 12.0}
    made.close()
    assert made.run.finished


def test_an_entity_and_a_name_are_passed_and_the_rewind_is_said(tmp_path, monkeypatch, caplog):
    """A run name and entity given are W&B's; a rewind needs a segment of this run id (another run's
    folder is not one) and is said in one line; a refused one in a warning."""
    wandb = pytest.importorskip("wandb")
    from engine.observe.sinks import WandbSink

    calls, refuse = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs.get("resume_from") and refuse:
            raise wandb.errors.CommError("no rewind here")
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    cfg = SimpleNamespace(wandb_project="proj", wandb_entity="team", wandb_run_name="named", wandb_tags=[])
    (tmp_path / "wandb" / "offline-run-20260101_000000-other999").mkdir(parents=True)
    WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=4)
    assert (calls[0]["entity"], calls[0]["name"], calls[0]["resume"]) == ("team", "named", "allow")
    (tmp_path / "wandb" / "offline-run-20260101_000000-abcd1234").mkdir()
    with caplog.at_level("INFO", logger="quadra"):
        WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=4)
        refuse.append(True)
        WandbSink(cfg, str(tmp_path), "abcd1234", {}, rewind_to=2)
    assert calls[1]["resume_from"] == "abcd1234?_step=4"
    assert [r.getMessage() for r in caplog.records] == [
        "W&B run abcd1234 rewound to step 4: this attempt's records of later steps replace the earlier ones",
        "W&B refused to rewind run abcd1234 to step 2 (no rewind here): it continues without, and keeps its first "
        "record of each step trained again"]


@pytest.fixture
def no_login(tmp_path, monkeypatch):
    """No W&B credentials or settings from this machine (tests/integration/test_wandb.py's helper): HOME is tmp/home."""
    pytest.importorskip("wandb")
    from tests.integration.test_wandb import _no_wandb_credentials

    _no_wandb_credentials(tmp_path, monkeypatch)
    monkeypatch.delenv("WANDB_CONFIG_DIR")
    return tmp_path / "home"


def test_the_settings_file_wandb_offline_writes_is_read_where_wandb_reads_it(no_login, tmp_path, monkeypatch, capfd):
    """`wandb offline` writes mode = offline into ~/.config/wandb/settings, or $WANDB_CONFIG_DIR/settings:
    either makes the run need no credentials; the same file elsewhere does not; nothing is printed."""
    from engine.observe.sinks import wandb_credentials_problem

    offline = "[default]\nmode = offline\n"
    assert wandb_credentials_problem() is not None
    (no_login / ".config" / "wandb").mkdir(parents=True)
    (no_login / ".config" / "wandb" / "settings").write_text(offline)
    assert wandb_credentials_problem() is None
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    assert wandb_credentials_problem() is not None  # $WANDB_CONFIG_DIR replaces ~/.config/wandb
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "settings").write_text(offline)
    assert wandb_credentials_problem() is None
    assert capfd.readouterr() == ("", "")


def test_the_refusal_names_the_netrc_file_and_the_fixes(no_login, tmp_path, monkeypatch):
    from wandb.sdk.wandb_settings import Settings

    from engine.observe.sinks import _wandb_settings, wandb_credentials_problem

    base = _wandb_settings(Settings).base_url  # wandb's default server (its version's)
    tail = ("and WANDB_MODE is not offline: run `wandb login`, or set WANDB_API_KEY, or log locally with "
            "WANDB_MODE=offline (`wandb sync` uploads later) or turn W&B off with WANDB_MODE=disabled or "
            "metrics.enable_wandb = false")
    assert wandb_credentials_problem() == ("metrics.enable_wandb = true but W&B has no credentials for "
                                           f"{base} (WANDB_API_KEY is unset and ~/.netrc has no entry "
                                           f"for it) {tail}")
    monkeypatch.setenv("NETRC", str(tmp_path / "my-netrc"))
    assert f"and {tmp_path / 'my-netrc'} has no entry for it) " in wandb_credentials_problem()


def test_settings_or_a_netrc_key_wandb_rejects_give_wandbs_reason_on_one_line(no_login, monkeypatch):
    from wandb.sdk.wandb_settings import Settings

    from engine.observe.sinks import _wandb_settings, wandb_credentials_problem

    monkeypatch.setenv("WANDB_MODE", "sideways")
    with pytest.raises(ValueError) as error:
        _wandb_settings(Settings)
    line = wandb_credentials_problem()
    prefix = "metrics.enable_wandb = true but wandb refuses its settings: "
    assert line.startswith(prefix) and line[len(prefix):].split() == str(error.value).split()
    assert "\n" not in line and "sideways" in line
    monkeypatch.delenv("WANDB_MODE")
    base = _wandb_settings(Settings).base_url
    (no_login / ".netrc").write_text(f"machine {urlparse(base).hostname}\n  login user\n  password short\n")
    (no_login / ".netrc").chmod(0o600)
    line = wandb_credentials_problem()
    assert line.startswith(f"metrics.enable_wandb = true but the netrc key for {base} is not one W&B accepts (")
    assert line.endswith("): run `wandb login --relogin`, or set WANDB_API_KEY") and "\n" not in line
    from wandb.sdk.lib import wbauth

    with pytest.raises(Exception) as rejected:  # wandb's own reason for the same key
        wbauth.read_netrc_auth(host=base)
    assert line[line.index("accepts (") + 9:line.rindex("): run")].split() == str(rejected.value).split()
