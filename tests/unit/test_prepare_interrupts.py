"""scripts/prepare_data.py when stopped: Ctrl-C / SIGTERM give one line and exit 128 + signal with no
temporary folder left; the leftovers of a SIGKILLed preparation are removed by the next one; an input
named by a relative or an absolute path is the same input."""

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from engine.data.prepare import prepare, scratch_folder
from tests.prepared_utils import REPO, quiet, sets  # noqa: F401

pytestmark = pytest.mark.usefixtures("private_datasets_cache")

_INTERRUPTED = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from tests.prepared_utils import load_prepare_script
import engine.data.prepare as prepare

def stopped_while_writing(*args, **kwargs):  # the signal arrives in the middle of the work
    os.kill(os.getpid(), signal.{name})
    time.sleep(30)

prepare._write_shards = stopped_while_writing
sys.exit(load_prepare_script().main([{raw!r}, {out!r}, "--tokenizer", {tok!r}, "--num_proc", "1"]))
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stopped_preparation_says_so_in_one_line_and_leaves_nothing(sets, tok, tmp_path, name):
    out = tmp_path / "work" / "out"
    os.makedirs(out.parent)
    script = _INTERRUPTED.format(repo=REPO, name=name, raw=sets["a"].raw, out=str(out), tok=tok.path)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 128 + getattr(signal, name), run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip() and "examples/s" not in line]  # not progress
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"prepare_data: stopped by {name}; {out} was not written")
    assert os.listdir(out.parent) == []  # neither the output nor a hidden temporary folder


def test_the_leftovers_of_a_killed_preparation_are_removed_by_the_next(sets, tok, tmp_path):
    out = tmp_path / "out"
    host = socket.gethostname().replace("-", "_")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".out.cache-{host}-{gone}-abc"  # a process that no longer exists
    live = tmp_path / f".out.tmp-{host}-{os.getpid()}-abc"  # a preparation still running (this process)
    other = tmp_path / f".out.cache-elsewhere-{gone}-abc"  # another host's: never touched
    for folder in (stale, live, other):
        os.makedirs(folder)
        (folder / "ids.arrow").write_bytes(b"x")
    lines = []
    prepare(sets["a"].raw, str(out), tok.path, num_proc=1, log=lines.append)
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name, "out"])
    assert any(f"removed {stale}" in line and f"process {gone} is gone" in line for line in lines), lines
    made = scratch_folder(str(out), "tmp", quiet)  # ours is created beside them and the live one stays
    assert os.path.basename(made).startswith(f".out.tmp-{host}-{os.getpid()}-") and os.path.isdir(live)
    shutil.rmtree(made)


def test_an_input_named_relatively_or_absolutely_is_the_same_input(sets, tok, tmp_path, monkeypatch, capsys):
    shutil.copy(sets["a"].raw, tmp_path / "corpus.jsonl")
    monkeypatch.chdir(tmp_path)
    prepare("corpus.jsonl", "out", tok.path, num_proc=1, log=quiet)
    lines = []
    prepare(str(tmp_path / "corpus.jsonl"), str(tmp_path / "out"), tok.path, num_proc=1, log=lines.append)
    assert any("already prepared" in line for line in lines), lines
