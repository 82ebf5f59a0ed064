"""The hang watchdog's rules (engine/observe/hang.py's docstrings) one at a time, without launching: which
files are a rank's record, when a fired watchdog ends its rank, what it writes, which collective a
Flight Recorder record says the others wait in (several groups, point-to-point entries, a group without
a name), and the grammar of ``QUADRA_TEST_FAULT``. tests/unit/test_recovery_units.py has the basic cases,
tests/integration/test_recovery.py the real faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.observe import hang
from engine.observe.hang import HANG_EXIT, HangWatchdog, attempt_number, await_records, missing_ranks, recorded_ranks
from tests.training_utils import REPO


def _fr(folder, rank: int, entries: list[dict]) -> None:
    """A Flight Recorder dump (torch's JSON) with ``entries`` (group "name:desc", seq, op, created, p2p)."""
    records = [{"process_group": e["group"].split(":"), "collective_seq_id": e["seq"], "profiling_name": e["op"],
                "is_p2p": e.get("p2p", False), "time_created_ns": e["created"]} for e in entries]
    (folder / f"rank-{rank}.fr.json").write_text(json.dumps({"entries": records}))


def _entry(group: str, seq: int, op: str, created: int, p2p: bool = False) -> dict:
    return {"group": group, "seq": seq, "op": op, "created": created, "p2p": p2p}


def test_a_record_is_a_stack_file_or_the_agents_frozen_mark(tmp_path):
    """recorded_ranks: rank-R.txt (written last, so complete) and rank-R.frozen count; a Flight Recorder
    file, a .txt still being written (.tmp) or a name without a rank number do not."""
    for name in ("rank-0.txt", "rank-12.frozen", "rank-3.fr.json", "rank-4.txt.tmp", "rank-x.txt", "rank-.txt",
                 "other-5.txt"):
        (tmp_path / name).write_text("x")
    assert recorded_ranks(str(tmp_path)) == {0, 12}
    assert recorded_ranks(str(tmp_path / "missing")) == set()


def test_waiting_for_records_ends_when_every_rank_wrote_or_at_the_timeout(tmp_path):
    (tmp_path / "rank-0.txt").write_text("x")
    (tmp_path / "rank-1.frozen").write_text("x")
    start = time.monotonic()
    await_records(str(tmp_path), 2, timeout_s=20.0)
    assert time.monotonic() - start < 1.0  # both there: no wait
    start = time.monotonic()
    await_records(str(tmp_path), 3, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5.0  # rank 2 never writes: the timeout ends the wait
    late = threading.Timer(0.2, lambda: (tmp_path / "rank-2.txt").write_text("x"))
    late.start()
    start = time.monotonic()
    await_records(str(tmp_path), 3, timeout_s=20.0)
    assert time.monotonic() - start < 0.8  # checked every 0.1 s: rank 2's record ends the wait at once
    late.join()


def test_the_attempt_is_torchruns_restart_count(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_number() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "")
    assert attempt_number() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert attempt_number() == 3
    assert HangWatchdog(0, str(tmp_path), rank=0, exit=lambda code: None).folder == \
        str(tmp_path / "hangs" / "attempt-3")


def _fire(tmp_path, monkeypatch, trace: str | None, **kwargs) -> tuple[list[int], str]:
    """A watchdog of rank 2 with a 0.2 s timeout, left without beats after step 7; -> (exit codes, folder)."""
    monkeypatch.setattr(hang, "_flight_recorder", lambda: trace)
    ended, codes = threading.Event(), []
    watchdog = HangWatchdog(0.2, str(tmp_path), rank=2, exit=lambda code: (codes.append(code), ended.set()), **kwargs)
    watchdog.beat(7)
    assert ended.wait(5), "the watchdog did not fire"
    watchdog.close()
    return codes, watchdog.folder


def test_a_fired_watchdog_writes_its_flight_recorder_record_and_the_line_of_its_stacks(tmp_path, monkeypatch):
    trace = '{"entries": []}'
    codes, folder = _fire(tmp_path, monkeypatch, trace)
    assert codes == [HANG_EXIT] == [124]
    with open(os.path.join(folder, "rank-2.fr.json")) as f:
        assert f.read() == trace
    with open(os.path.join(folder, "rank-2.txt")) as f:
        first = f.readline()
    head, _, rest = first.partition(" s in step 7 ")
    assert head.startswith("rank 2: no progress for ") and float(head.rsplit(" ", 1)[1]) >= 0.2  # "{idle:.1f}"
    assert rest == "(comm.hang_timeout_seconds = 0.2); stacks of every thread:\n"
    assert sorted(os.listdir(folder)) == ["rank-2.fr.json", "rank-2.txt"]  # no .tmp left


def test_without_a_flight_recorder_the_stacks_are_still_written(tmp_path, monkeypatch):
    codes, folder = _fire(tmp_path, monkeypatch, None)
    assert codes == [HANG_EXIT] and sorted(os.listdir(folder)) == ["rank-2.txt"]


def test_a_rank_writes_beside_the_records_of_the_others_and_before_a_beat_it_is_in_step_0(tmp_path, monkeypatch):
    """Every rank of a node writes into the same hangs/attempt-K (another rank may have made it); a rank
    that hangs before its first step (no beat yet) says step 0."""
    monkeypatch.setattr(hang, "_flight_recorder", lambda: None)
    folder = tmp_path / "hangs" / "attempt-0"
    folder.mkdir(parents=True)
    (folder / "rank-0.txt").write_text("rank 0: no progress")
    ended = threading.Event()
    watchdog = HangWatchdog(0.2, str(tmp_path), rank=1, exit=lambda code: ended.set(), world_size=2)
    assert ended.wait(5)
    watchdog.close()
    assert (folder / "rank-1.txt").read_text().partition(" s ")[2].startswith("in step 0 (")


def test_the_watchdog_polls_every_quarter_timeout_at_most_every_second(tmp_path):
    """The class docstring's poll, min(1 s, timeout / 4), read from the wait the thread makes."""
    class Stop:
        def __init__(self):
            self.waits = []

        def wait(self, seconds):
            self.waits.append(seconds)
            return True  # closed: the loop ends

    for timeout, poll in ((0.4, 0.1), (2.0, 0.5), (4.0, 1.0), (40.0, 1.0)):
        watchdog = HangWatchdog(0, str(tmp_path), rank=0, exit=lambda code: None)
        watchdog.timeout_s, watchdog._stop = timeout, Stop()
        watchdog._watch()
        assert watchdog._stop.waits == [poll]


def test_a_run_that_ends_without_closing_its_watchdog_is_not_held_by_it(tmp_path):
    """The watchdog thread must not keep a finished process alive (it would exit 124 a timeout later)."""
    HangWatchdog(600, str(tmp_path), 0).close()  # in this process too: mutmut picks tests by what they call here
    root = REPO
    code = f"from engine.observe.hang import HangWatchdog; HangWatchdog(600, {str(tmp_path)!r}, 0)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, timeout=20)
    assert proc.returncode == 0 and not (tmp_path / "hangs").exists(), proc.stderr.decode()[-2000:]


def test_the_attempt_ends_even_when_the_record_cannot_be_written(tmp_path, monkeypatch, caplog):
    """The attempt ends, and the rank says why its record is missing (no exception left in the thread)."""
    (tmp_path / "hangs").write_text("a file where the folder should be")
    with caplog.at_level("ERROR", logger="quadra"):
        codes, folder = _fire(tmp_path, monkeypatch, None, world_size=4)
    assert codes == [HANG_EXIT] and not os.path.isdir(folder)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"rank 2: no hang record written to {folder}: ") and "Not a directory" in line


def test_no_watchdog_without_a_timeout_and_none_after_close(tmp_path):
    """timeout <= 0: no thread at all; close() before the timeout: it never fires."""
    codes = []
    off = HangWatchdog(0, str(tmp_path), rank=0, exit=codes.append)
    negative = HangWatchdog(-1, str(tmp_path), rank=0, exit=codes.append)
    closed = HangWatchdog(0.2, str(tmp_path), rank=0, exit=codes.append)
    closed.close()
    time.sleep(0.6)
    assert off._thread is None and negative._thread is None and codes == []
    assert not (tmp_path / "hangs").exists()


def test_the_flight_recorder_dump_is_read_as_text_or_none(monkeypatch, caplog):
    """torch's _dump_fr_trace_json returns bytes (or str); a failure gives None, not an exception."""
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda: b'{"entries": []}', raising=False)
    assert hang._flight_recorder() == '{"entries": []}'
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda: '{"version": 2}', raising=False)
    assert hang._flight_recorder() == '{"version": 2}'

    def fails():
        raise RuntimeError("no process group")

    monkeypatch.setattr(c10d, "_dump_fr_trace_json", fails, raising=False)
    with caplog.at_level("DEBUG", logger="quadra"):
        assert hang._flight_recorder() is None
    assert [r.getMessage() for r in caplog.records] == ["no Flight Recorder record: no process group"]


def test_of_several_groups_with_an_absent_rank_the_collective_created_last_is_named(tmp_path):
    """tp2 x dp2: rank 1 never entered tp's all-reduce #7 (rank 0 waits in it), rank 3 never entered
    dp's all-gather #20 (rank 2 waits in it). The verdict names the one created last (by the waiting
    ranks' newest entry); point-to-point entries (a pipeline's send/recv) are no collective."""
    def write(tp_created: int, dp_created: int) -> None:
        _fr(tmp_path, 0, [_entry("2:tp", 8, "gloo:recv", 5, p2p=True), _entry("2:tp", 6, "gloo:all_reduce", 10),
                          _entry("2:tp", 7, "gloo:all_reduce", tp_created)])
        _fr(tmp_path, 1, [_entry("2:tp", 6, "gloo:all_reduce", 10), _entry("2:tp", 9, "gloo:send", 99, p2p=True)])
        _fr(tmp_path, 2, [_entry("1:dp", 19, "gloo:all_gather", 10), _entry("1:dp", 20, "gloo:all_gather", dp_created)])
        _fr(tmp_path, 3, [_entry("1:dp", 19, "gloo:all_gather", 10)])

    write(tp_created=500, dp_created=900)
    assert missing_ranks(str(tmp_path)) == ([2], "gloo:all_gather #20 of process group dp", [3])
    write(tp_created=900, dp_created=500)
    assert missing_ranks(str(tmp_path)) == ([0], "gloo:all_reduce #7 of process group tp", [1])


def test_a_group_waited_in_is_dated_by_its_newest_waiting_rank(tmp_path):
    """Ranks 0 and 1 wait in group a's #3, created at 100 and 800; rank 2 waits in group b's #5 at 500:
    group a's collective was created last (800), whatever order the waiting ranks come in."""
    _fr(tmp_path, 0, [_entry("5:a", 3, "gloo:broadcast", 100), _entry("6:b", 4, "gloo:all_reduce", 10)])
    _fr(tmp_path, 1, [_entry("5:a", 3, "gloo:broadcast", 800)])
    _fr(tmp_path, 2, [_entry("5:a", 2, "gloo:broadcast", 50), _entry("6:b", 5, "gloo:all_reduce", 500)])
    assert missing_ranks(str(tmp_path)) == ([0, 1], "gloo:broadcast #3 of process group a", [2])


def test_a_group_without_a_description_is_named_by_its_number_and_a_bad_record_is_skipped(tmp_path, monkeypatch):
    """A record that cannot be read, or holds no entries, is skipped, whatever order the files come in
    (here the bad ones first)."""
    every = hang.glob.glob
    monkeypatch.setattr(hang.glob, "glob", lambda pattern: sorted(every(pattern)))
    (tmp_path / "rank-0.fr.json").write_text("{not json")
    (tmp_path / "rank-1.fr.json").write_text(json.dumps({"version": "2.4"}))
    _fr(tmp_path, 2, [_entry("3:undefined", 2, "gloo:all_reduce", 5), _entry("3:undefined", 1, "gloo:x", 1)])
    _fr(tmp_path, 3, [_entry("3:undefined", 1, "gloo:all_reduce", 1)])
    assert missing_ranks(str(tmp_path)) == ([2], "gloo:all_reduce #2 of process group 3", [3])
    assert missing_ranks(str(tmp_path / "empty")) is None


def test_an_entry_without_a_group_number_or_name_is_unknown_not_an_error(tmp_path):
    """Fields a Flight Recorder entry may lack: its group and op read "?", its sequence number 0 (so a
    rank with nothing newer never entered #1), its time 0."""
    (tmp_path / "rank-0.fr.json").write_text(json.dumps({"entries": [{"collective_seq_id": 1}]}))
    (tmp_path / "rank-1.fr.json").write_text(json.dumps({"entries": [{"profiling_name": "gloo:barrier"}]}))
    assert missing_ranks(str(tmp_path)) == ([0], "? #1 of process group ?", [1])


@pytest.fixture
def faults(monkeypatch):
    """test_hook with its effects recorded instead of done: ("kill", pid, signal), ("sleep", s), ("crash", kind)."""
    done = []
    monkeypatch.setattr(hang.os, "kill", lambda pid, sig: done.append(("kill", pid, sig)))
    monkeypatch.setattr(hang.time, "sleep", lambda s: done.append(("sleep", s)))
    monkeypatch.setattr(hang, "_crash", lambda kind: done.append(("crash", kind)))
    for name in ("QUADRA_TEST_FAULT", "QUADRA_REPLICA_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)

    def run(spec: str, step: int, rank: int, **env) -> list:
        monkeypatch.setenv("QUADRA_TEST_FAULT", spec)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        done.clear()
        hang.test_hook(step, rank, wait_for_every_group=lambda: done.append(("rejoin",)))
        return list(done)

    return run


def test_a_test_fault_fires_at_its_rank_step_attempt_and_group_only(faults, monkeypatch):
    """``KIND:RANK:STEP[@ATTEMPT][:GROUP]`` (test_hook's docstring), several comma-separated."""
    me, parent = os.getpid(), os.getppid()
    assert faults("hang:1:5", 5, 1) == [("sleep", 24 * 3600)]
    assert faults("hang:1:5", 5, 0) == [] and faults("hang:1:5", 4, 1) == [] and faults("hang:1:5", 6, 1) == []
    assert faults("stop:any:3", 3, 7) == [("kill", me, signal.SIGSTOP)]
    assert faults("kill:0:2", 2, 0) == [("kill", me, signal.SIGKILL), ("sleep", 60)]
    assert faults("kill_node:any:2", 2, 3) == [("kill", parent, signal.SIGKILL), ("sleep", 60)]
    assert faults("rejoin:0:8:0", 8, 0, QUADRA_REPLICA_ID="0") == [("rejoin",)]
    assert faults("rejoin:0:8:0", 8, 0, QUADRA_REPLICA_ID="1") == []
    assert faults("kill:0:4:1", 4, 0, QUADRA_REPLICA_ID="1") == [("kill", me, signal.SIGKILL), ("sleep", 60)]
    for kind in ("abort", "segv", "double_free"):
        assert faults(f"{kind}:1:2", 2, 1) == [("crash", kind)]
    assert faults("bogus:1:2", 2, 1) == []
    # attempt: default 0; "@1" only in the first restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults("kill:1:7", 7, 1) == [] and faults("hang:1:10@1", 10, 1) == [("sleep", 24 * 3600)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults("kill:1:7,hang:1:10@1", 7, 1) == [("kill", me, signal.SIGKILL), ("sleep", 60)]
    assert faults("kill:1:7,hang:1:10@1", 10, 1) == []
    assert faults("kill:1:7,hang:0:7", 7, 0) == [("sleep", 24 * 3600)]
    monkeypatch.delenv("QUADRA_TEST_FAULT")
    hang.test_hook(7, 1)  # unset: nothing (the recording fakes would have raised nothing either way)


def test_rejoin_without_replica_groups_does_nothing(faults, monkeypatch):
    monkeypatch.setenv("QUADRA_TEST_FAULT", "rejoin:0:8")
    hang.test_hook(8, 0, wait_for_every_group=None)  # no torchft: nothing to wait for, no error


@pytest.mark.parametrize("kind, sig", [("abort", signal.SIGABRT), ("segv", signal.SIGSEGV),
                                       ("double_free", signal.SIGABRT)])
def test_the_crash_faults_end_the_process_with_their_signal(kind, sig):
    """What the suite's crash faults must do (tests/integration/test_recovery.py reads their stderr): end the process
    by that signal, as native code would."""
    root = REPO
    proc = subprocess.run([sys.executable, "-c", f"from engine.observe.hang import _crash; _crash({kind!r})"],
                          cwd=root, capture_output=True, timeout=60)
    assert proc.returncode == -sig, proc.stderr.decode()[-2000:]
