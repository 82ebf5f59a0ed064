"""The torch-free decisions of a run that keeps itself alive, without launching: which failure a
restart may cure, who a Flight Recorder record says never entered the collective, the line for a rank
that wrote no record (stopped or frozen) and the agent's handling of a stopped one, the goodput
arithmetic, and the refusal of an elastic range with every degree fixed (tests/integration/test_recovery.py
launches the real faults)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from engine.launch.failures import PEER_FAILURE, crash_report, crash_summary, failure_cause, incurable
from engine.observe.goodput import AttemptLedger, ledger
from engine.observe.hang import missing_ranks
from tests.training_utils import REPO


def test_only_deaths_without_a_reason_are_curable():
    lost_peer = {0: f"{PEER_FAILURE} during a collective (Connection reset by peer)"}
    assert not incurable(lost_peer)
    assert incurable({0: "set-up error: every checkpoint in 'x' is damaged", **{1: lost_peer[0]}})
    # The SIGKILLed rank is the cause, not the survivor that lost it or that torchrun stopped.
    assert failure_cause({0: 1, 1: -int(signal.SIGKILL)}, lost_peer) == "rank 1 ended with signal SIGKILL"
    assert failure_cause({0: -int(signal.SIGTERM), 1: 3}, {}) == "rank 1 ended with exit status 3"


def test_a_crash_report_is_read_back_from_the_ranks_stderr(tmp_path):
    """glibc's message (written without a newline, so faulthandler's first line follows on the same line)
    and faulthandler's block: the crashing thread's stack first; nothing from a file without them."""
    stderr = tmp_path / "stderr.log"
    stderr.write_text(
        "some warning\nmalloc(): unaligned tcache chunk detected\nFatal Python error: Aborted\n\n"
        'Thread 0x00007f01 (most recent call first):\n  File "/x/read.py", line 9 in _run\n\n'
        'Current thread 0x00007f02 (most recent call first):\n  File "/x/step.py", line 3 in step\n'
        '  File "/x/main.py", line 1 in <module>\n\nExtension modules: numpy (total: 1)\n')
    report = crash_report(str(stderr))
    assert report[:4] == ["malloc(): unaligned tcache chunk detected", "Fatal Python error: Aborted",
                          "Current thread 0x00007f02 (most recent call first):", '  File "/x/step.py", line 3 in step']
    assert report[-1] == '  File "/x/read.py", line 9 in _run'
    assert crash_summary(report) == ("malloc(): unaligned tcache chunk detected; Fatal Python error: Aborted; "
                                     "in step (/x/step.py:3)")
    stderr.write_text("free(): double free detected in tcache 2Fatal Python error: Aborted\n")
    assert crash_report(str(stderr)) == ["free(): double free detected in tcache 2", "Fatal Python error: Aborted"]
    stderr.write_text("an ordinary warning\n")
    assert crash_report(str(stderr)) == [] and crash_report(str(tmp_path / "none")) == []
    assert failure_cause({0: -int(signal.SIGABRT)}, {}, {0: "malloc(): x"}) == "rank 0 ended with signal SIGABRT: malloc(): x"


def _fr(folder, rank: int, collectives: list[tuple[str, int, str]]) -> None:
    """A Flight Recorder record (torch's JSON dump) of ``(group, sequence number, op)`` entries."""
    entries = [{"process_group": [group.split(":")[0], group.split(":")[1]], "collective_seq_id": seq,
                "profiling_name": op, "is_p2p": False, "time_created_ns": 10 * seq} for group, seq, op in collectives]
    (folder / f"rank-{rank}.fr.json").write_text(json.dumps({"entries": entries}))


def test_the_flight_recorder_names_the_ranks_that_never_entered(tmp_path):
    # 4 ranks, two dp groups; ranks 0, 1, 3 wait in the default group's 5th all-reduce, rank 2 is
    # still at its 4th; the subgroup counts agree (every rank finished them).
    for rank in range(4):
        default = [("0:default_pg", seq, "gloo:all_reduce") for seq in range(1, 5 if rank == 2 else 6)]
        _fr(tmp_path, rank, [("1:dp", 1, "gloo:reduce_scatter"), ("1:dp", 2, "gloo:all_gather"), *default])
    assert missing_ranks(str(tmp_path)) == ([0, 1, 3], "gloo:all_reduce #5 of process group default_pg", [2])
    _fr(tmp_path, 2, [("0:default_pg", seq, "gloo:all_reduce") for seq in range(1, 6)])
    assert missing_ranks(str(tmp_path)) is None  # everyone is in #5: a hang inside it, nobody absent


def test_the_ledger_counts_steps_trained_again_once(tmp_path):
    clock = iter(range(100, 200)).__next__
    state = str(tmp_path)
    first = AttemptLedger(state, 0, launch_time=90.0, resumed_from=0, clock=clock)
    for step in range(1, 7):
        first.step_started()
        first.step_done(step, 1.0)
    (tmp_path / "attempt-0.end.json").write_text(json.dumps({"attempt": 0, "cause": "rank 1 died", "failed_at": 110.0}))
    (tmp_path / "restart-1.json").write_text(json.dumps({"attempt": 1, "cause": "rank 1 died", "failed_at": 110.0}))
    (tmp_path / "attempt-1.start.json").write_text(json.dumps({"attempt": 1, "started_at": 112.0}))
    second = AttemptLedger(state, 1, launch_time=90.0, resumed_from=4, clock=iter([115.0]).__next__)
    assert second.retrained_range() == (5, 6)
    second.step_started()
    for step in range(5, 13):
        second.step_done(step, 1.0)
    records, summary = ledger(state, [first.record, second.record], 90.0, end_time=130.0)
    assert [(r["startup_s"], r["recovery_s"], r["end"]) for r in records] == [(10.0, None, "rank 1 died"),
                                                                             (3.0, 5.0, "completed")]
    assert [r["retrained_steps"] for r in records] == [[], [5, 6]]
    assert (summary["productive_s"], summary["retrained_s"], summary["goodput"]) == (12.0, 2.0, 12.0 / 40.0)


@pytest.mark.parametrize("dp_shard, refused", [(2, True), (-1, False)])
def test_an_elastic_range_needs_a_degree_that_absorbs_it(dp_shard, refused, monkeypatch, capsys, tmp_path):
    from engine.launch import launcher

    monkeypatch.setenv("NNODES", "1:2")
    monkeypatch.setenv("NGPU", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(launcher, "_launch", lambda *args: 0)  # the pre-flight only, no torchrun
    config = os.path.join(REPO, "train_configs", "debug_model.toml")
    status = launcher.main(["--job.config_file", config, "--parallelism.dp_shard", str(dp_shard),
                            "--job.dump_folder", str(tmp_path), "--job.device", "cpu"])
    err = capsys.readouterr().err
    if refused:
        assert status == 2 and err.strip().splitlines() == [
            "set-up error: NNODES=1:2 lets the group shrink to 1 node, but every degree is fixed "
            "(parallelism.dp_shard = 2): set parallelism.dp_shard = -1 so that it absorbs the nodes that are "
            "gone, or NNODES=2"], err
    else:
        assert status == 0, err


def test_the_watchdog_writes_the_stacks_and_ends_a_rank_without_progress(tmp_path):
    import threading
    import time

    from engine.observe.hang import HANG_EXIT, HangWatchdog, hang_folder

    ended = threading.Event()
    codes = []
    watchdog = HangWatchdog(0.3, str(tmp_path), rank=3, exit=lambda code: (codes.append(code), ended.set()))
    for step in range(1, 6):  # beats keep it quiet
        watchdog.beat(step)
        time.sleep(0.1)
    assert not ended.is_set()
    assert ended.wait(5), "the watchdog did not fire"
    assert codes == [HANG_EXIT]
    text = (tmp_path / "hangs" / "attempt-0" / "rank-3.txt").read_text()
    assert hang_folder(str(tmp_path), 0) == str(tmp_path / "hangs" / "attempt-0")
    assert text.startswith("rank 3: no progress for") and " in step 5 " in text
    assert "in test_the_watchdog_writes_the_stacks" in text  # the main thread's stack, not only its own
    watchdog.close()


def test_a_fired_watchdog_ends_its_rank_only_once_every_rank_wrote_its_record(tmp_path):
    """torchrun's agent stops every rank when one exits: a rank whose watchdog fired first must wait
    for the others' records (their watchdogs fire up to a poll later), or the verdict lacks them."""
    import threading
    import time

    from engine.observe.hang import HangWatchdog, hang_folder

    ended = threading.Event()
    watchdog = HangWatchdog(0.2, str(tmp_path), rank=1, exit=lambda code: ended.set(), world_size=2)
    folder = hang_folder(str(tmp_path), 0)
    deadline = time.monotonic() + 5
    while not os.path.exists(os.path.join(folder, "rank-1.txt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(os.path.join(folder, "rank-1.txt")), "the watchdog did not fire"
    assert not ended.wait(0.5), "it ended its rank before rank 0's record was written"
    with open(os.path.join(folder, "rank-0.txt"), "w") as f:
        f.write("rank 0: no progress")
    assert ended.wait(5), "it did not end its rank once every record was there"
    watchdog.close()


def _record(folder, rank: int, step: int, waits_in: tuple[str, int, str] | None) -> None:
    """A rank's own hang record: its stack file and a Flight Recorder dump whose newest entry is ``waits_in``."""
    (folder / f"rank-{rank}.txt").write_text(f"rank {rank}: no progress for 10.2 s in step {step} "
                                             "(comm.hang_timeout_seconds = 10); stacks of every thread:\n")
    if waits_in is not None:
        _fr(folder, rank, [(waits_in[0], waits_in[1] - 1, waits_in[2]), waits_in])


def test_a_rank_that_wrote_no_record_is_named_with_the_collective_the_others_wait_in(tmp_path):
    """Issue #48 item 3: rank 1 SIGSTOPped wrote nothing; rank 0 waits in the all-gather of step 5. The
    line names rank 1 as stopped (from the agent's mark or its /proc state) and what it never reached;
    a silent rank that is not stopped is called frozen; 4 ranks waiting in two collectives name both."""
    from engine.launch.frozen import hang_verdict

    _record(tmp_path, 0, 5, ("0:default_pg", 12, "gloo:all_gather_into_tensor_coalesced"))
    where = f"the stacks of rank 0 are in {tmp_path}"
    stopped = ("quadra: hang: rank 1 made no progress for 30 s (comm.hang_timeout_seconds) and wrote no record: "
               "rank 1 was stopped (SIGSTOP: state T in /proc/<pid>/stat), so it never reached "
               "gloo:all_gather_into_tensor_coalesced #12 of process group default_pg, which rank 0 waits in at "
               f"step 5; {where}")
    assert hang_verdict(str(tmp_path), 2, 30, {0: "S", 1: "T"}) == stopped
    (tmp_path / "rank-1.frozen").write_text(json.dumps({"rank": 1, "pid": 4242, "state": "T"}))
    assert hang_verdict(str(tmp_path), 2, 30) == stopped  # the mark alone (another node's agent wrote it)
    (tmp_path / "rank-1.frozen").unlink()
    assert hang_verdict(str(tmp_path), 2, 30, {1: "R"}) == stopped.replace(
        "rank 1 was stopped (SIGSTOP: state T in /proc/<pid>/stat)",
        "rank 1 was frozen (no record from its watchdog thread)")

    # tp2 x fsdp2: rank 1 stopped; rank 0 waits in its tp all-reduce, ranks 2, 3 in the dp all-gather.
    _record(tmp_path, 0, 4, ("2:tp", 7, "gloo:all_reduce"))
    for rank in (2, 3):
        _record(tmp_path, rank, 4, ("1:dp_shard", 20, "gloo:_allgather_base"))
    assert hang_verdict(str(tmp_path), 4, 30, {1: "T"}) == (
        "quadra: hang: rank 1 made no progress for 30 s (comm.hang_timeout_seconds) and wrote no record: rank 1 was "
        "stopped (SIGSTOP: state T in /proc/<pid>/stat), so it never reached gloo:all_reduce #7 of process group tp, "
        "which rank 0 waits in at step 4, nor gloo:_allgather_base #20 of process group dp_shard, which rank 2,3 "
        f"wait in at step 4; the stacks of rank 0,2,3 are in {tmp_path}")


def test_the_agent_marks_a_stopped_rank_once_a_hang_record_is_there_and_kills_it(tmp_path):
    """A stopped process (SIGSTOP) is marked ``rank-R.frozen`` (which the waiting ranks count as its
    record) only once another rank's record shows a hang, and is SIGKILLed (it dies without being
    continued) once every rank has a record; a running rank with a record of its own is left alone."""
    import subprocess
    import sys

    from engine.launch.frozen import kill_silent, mark_stopped, proc_state, settle_hang
    from engine.observe.hang import recorded_ranks

    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        sleepers[1].send_signal(signal.SIGSTOP)
        pids = {rank: proc.pid for rank, proc in enumerate(sleepers)}
        for _ in range(50):
            if proc_state(pids[1]) == "T":
                break
            time.sleep(0.05)
        assert proc_state(pids[1]) == "T" and proc_state(pids[0]) in ("S", "R")
        assert settle_hang(str(tmp_path), pids, 3) == {}  # no record yet: no hang
        _record(tmp_path, 0, 5, None)
        # Rank 2 (another node's) has no record yet: mark rank 1, do not kill it while rank 2 may still write.
        assert mark_stopped(str(tmp_path), pids) == {1: "T"} and recorded_ranks(str(tmp_path)) == {0, 1}
        assert proc_state(pids[1]) == "T"
        (tmp_path / "rank-2.txt").write_text("rank 2: no progress for 10.1 s in step 5\n")
        started = time.monotonic()
        assert settle_hang(str(tmp_path), pids, 3) == {1: "T"}  # every record there: killed
        assert sleepers[1].wait(5) == -signal.SIGKILL and time.monotonic() - started < 5
        assert sleepers[0].poll() is None  # it wrote its record: torchrun stops it as usual
        assert kill_silent(str(tmp_path), pids) == {}
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
