"""The rules of a failed attempt's verdict (engine/launch/failures.py's docstrings) one at a time: which
rank is the root cause, how an exit code reads, which reasons a restart cannot cure, which files are
ranks' reasons, and what of a rank's stderr is its crash report (glibc's lines just before
faulthandler's block, the crashing thread first, the tail of the file only, at most REPORT_LINES).
tests/unit/test_recovery_units.py has the basic cases, tests/integration/test_recovery.py the real crashes."""

from __future__ import annotations

import os
import signal

from engine.launch.failures import (GLIBC_LINES, PEER_FAILURE, REPORT_LINES, TAIL_BYTES, crash_report, crash_summary,
                                    failure_cause, how_it_ended, incurable, read_reasons)

LOST = f"{PEER_FAILURE} during a collective (Connection reset by peer)"


def test_an_exit_code_reads_as_a_signal_or_a_status():
    assert how_it_ended(-int(signal.SIGKILL)) == "signal SIGKILL"
    assert how_it_ended(-int(signal.SIGSEGV)) == "signal SIGSEGV"
    assert how_it_ended(-99) == "signal 99"  # no such signal: its number
    assert how_it_ended(0) == "exit status 0" and how_it_ended(1) == "exit status 1"


def test_the_root_cause_is_the_lowest_rank_that_died_of_its_own():
    """Lowest rank first; a SIGTERM (torchrun stopping survivors) and a lost peer are collateral; a
    crash summary follows the root rank only."""
    term = -int(signal.SIGTERM)
    assert failure_cause({0: term, 3: -9, 2: 1}, {}) == "rank 2 ended with exit status 1"
    assert failure_cause({0: 1, 2: 1}, {0: LOST}) == "rank 2 ended with exit status 1"
    assert failure_cause({1: -6, 2: -6}, {}, {1: "free(): x", 2: "malloc(): y"}) == \
        "rank 1 ended with signal SIGABRT: free(): x"
    assert failure_cause({1: -6, 2: -6}, {}, {2: "malloc(): y"}) == "rank 1 ended with signal SIGABRT"
    assert failure_cause({4: 0}, {}, {4: ""}) == "rank 4 ended with exit status 0"
    # a reason of its own (not a lost peer) makes the rank a root even though it exited normally
    assert failure_cause({1: 1}, {1: "set-up error: x"}) == "rank 1 ended with exit status 1"


def test_with_only_collateral_ranks_the_lowest_is_named_as_having_lost_a_peer():
    term = -int(signal.SIGTERM)
    assert failure_cause({3: 1, 2: term}, {3: LOST}) == (
        "rank 2 lost a peer (a rank on another node failed first) and ended with signal SIGTERM")
    assert failure_cause({5: 1}, {5: LOST}) == (
        "rank 5 lost a peer (a rank on another node failed first) and ended with exit status 1")
    assert failure_cause({}, {}) == "the worker group failed"


def test_only_a_reason_of_its_own_is_incurable():
    assert not incurable({}) and not incurable({0: LOST, 1: PEER_FAILURE})
    assert incurable({0: LOST, 1: "out of memory"})
    assert incurable({0: f"an error: {PEER_FAILURE}"})  # the mark must open the line


def test_reasons_are_read_from_rank_n_err_files(tmp_path):
    (tmp_path / "rank0.err").write_text("  set-up error: x\n")
    (tmp_path / "rank12.err").write_text(LOST)
    (tmp_path / "rank3.err").write_text("\n")  # empty: no reason
    (tmp_path / "rankx.err").write_text("no rank number")
    (tmp_path / "rank4.log").write_text("not a reason")
    (tmp_path / "rank5.err").mkdir()  # unreadable
    assert read_reasons(str(tmp_path)) == {0: "set-up error: x", 12: LOST}
    assert read_reasons(str(tmp_path / "missing")) == {}


FAULT = ["Fatal Python error: Segmentation fault", "",
         "Thread 0x01 (most recent call first):", '  File "/x/a.py", line 1 in loader', "",
         "Thread 0x02 (most recent call first):", '  File "/x/b.py", line 2 in saver', "",
         "Current thread 0x03 (most recent call first):", '  File "/x/c.py", line 3 in step',
         '  File "/x/d.py", line 4 in main', "", "Extension modules: numpy, torch (total: 2)"]


def test_the_crashing_thread_comes_first_then_the_others_in_their_order(tmp_path):
    path = tmp_path / "stderr.log"
    path.write_text("\n".join(["step 3 loss 2.1", *FAULT]) + "\n")
    assert crash_report(str(path)) == [
        "Fatal Python error: Segmentation fault",
        "Current thread 0x03 (most recent call first):", '  File "/x/c.py", line 3 in step',
        '  File "/x/d.py", line 4 in main',
        "Thread 0x01 (most recent call first):", '  File "/x/a.py", line 1 in loader',
        "Thread 0x02 (most recent call first):", '  File "/x/b.py", line 2 in saver']


def test_only_glibc_lines_just_before_the_fault_and_the_last_fault_count(tmp_path):
    """glibc's lines among the GLIBC_LINES before faulthandler's (or the file's end), whether its last
    message ends its line or faulthandler's follows on the same line; of two faulthandler blocks (a rank
    that crashed twice in one file) the last one."""
    path = tmp_path / "stderr.log"
    old = ["corrupted size vs. prev_size"] + [f"line {i}" for i in range(GLIBC_LINES)]  # one line too far
    path.write_text("\n".join(["Fatal Python error: Aborted", "Current thread 0x09 (most recent call first):",
                               '  File "/x/old.py", line 9 in old', *old, "free(): invalid pointer", *FAULT]))
    report = crash_report(str(path))
    assert report[:2] == ["free(): invalid pointer", "Fatal Python error: Segmentation fault"]
    assert not any("old" in line or "corrupted" in line for line in report)
    glibc = [f"free(): invalid size {i}" for i in range(GLIBC_LINES)]
    for text in ("\n".join(["malloc(): x", *glibc, *FAULT]), "\n".join(["malloc(): x", *glibc]) + "\n".join(FAULT)):
        path.write_text(text)
        assert crash_report(str(path))[:GLIBC_LINES + 1] == [*glibc, "Fatal Python error: Segmentation fault"]
    tail = [f"line {i}" for i in range(GLIBC_LINES - 1)]
    path.write_text("\n".join(["x", "munmap_chunk(): invalid pointer", *tail]))  # no fault: up to the end
    assert crash_report(str(path)) == ["munmap_chunk(): invalid pointer"]
    path.write_text("\n".join(["munmap_chunk(): invalid pointer", *tail, "one more"]))
    assert crash_report(str(path)) == []
    path.write_text("*** stack smashing detected ***: terminated\n")
    assert crash_report(str(path)) == ["*** stack smashing detected ***: terminated"]
    assert crash_report(None) == [] and crash_report("") == []


def test_bytes_that_are_no_utf8_and_lines_before_the_first_thread_do_not_break_the_report(tmp_path):
    """A rank's stderr may hold any bytes (a native library's output, a UTF-8 character cut by the tail's
    first byte); faulthandler may print lines before the first thread (Py_FatalError: "Python runtime
    state: initialized"): the report is still read, without them."""
    path = tmp_path / "stderr.log"
    path.write_bytes(b"\xa9\xff binary \xc3\nfree(): invalid pointer\nFatal Python error: Aborted\n\n"
                     b"Python runtime state: initialized\n\nCurrent thread 0x1 (most recent call first):\n"
                     b'  File "/x/\xff.py", line 2 in f\n')
    assert crash_report(str(path)) == ["free(): invalid pointer", "Fatal Python error: Aborted",
                                       "Current thread 0x1 (most recent call first):",
                                       '  File "/x/\ufffd.py", line 2 in f']


def test_only_the_tail_of_the_stderr_is_read_and_the_report_is_capped(tmp_path):
    path = tmp_path / "stderr.log"
    filler = "x" * 99 + "\n"
    path.write_text("\n".join(FAULT) + "\n" + filler * (TAIL_BYTES // len(filler) + 1))
    assert crash_report(str(path)) == []  # the block lies before the last TAIL_BYTES
    path.write_text(filler * (TAIL_BYTES // len(filler) + 5) + "\n".join(FAULT) + "\n")
    assert crash_report(str(path))[0] == "Fatal Python error: Segmentation fault"
    many = [f'  File "/x/f.py", line {i} in f{i}' for i in range(100)]
    path.write_text("\n".join(["Fatal Python error: Aborted", "", "Current thread 0x1 (most recent call first):",
                               *many]) + "\n")
    report = crash_report(str(path))
    assert len(report) == REPORT_LINES == 60 and report[-1] == many[REPORT_LINES - 3]


def test_the_summary_names_glibc_the_fault_and_the_innermost_frame(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = os.path.join(str(tmp_path), "engine", "x.py")
    report = ["malloc(): corrupted top size", "double free or corruption (out)", "Fatal Python error: Aborted",
              "Current thread 0x1 (most recent call first):", f'  File "{here}", line 3 in f',
              '  File "/x/main.py", line 1 in <module>']
    assert crash_summary(report) == ("malloc(): corrupted top size; double free or corruption (out); "
                                     f"Fatal Python error: Aborted; in f ({os.path.join('engine', 'x.py')}:3)")
    outside = report[:4] + ['  File "/elsewhere/y.py", line 7 in g']
    assert crash_summary(outside).endswith("Fatal Python error: Aborted; in g (/elsewhere/y.py:7)")
    assert crash_summary(report[:4]) == "malloc(): corrupted top size; double free or corruption (out); " \
        "Fatal Python error: Aborted"  # no frame after the thread line
    assert crash_summary(["Fatal Python error: Aborted", "Thread 0x2 (most recent call first):",
                          '  File "/x/z.py", line 1 in z']) == "Fatal Python error: Aborted"  # no crashing thread
    assert crash_summary(["free(): invalid pointer"]) == "free(): invalid pointer"
    assert crash_summary([]) == ""
