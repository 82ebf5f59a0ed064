"""The exit status of ``python -m engine.launch`` (engine/launch/launcher.py) for each way a run ends,
in-process with torchrun, the config and the pre-flight stubbed (tests/integration/test_launch.py launches for
real), and the launch numbers it reads (engine/launch/environment.py). Oracles: the module's docstring: a
pre-flight or launch-setting problem is one line and exit 2; a failure exits with the ranks' status (2 for
set-up errors, 1 for a signal or a rank without its code); a second Ctrl-C exits 130; SIGTERM / SIGUSR1 /
the first SIGINT are forwarded to the ranks."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import types

import pytest

from engine.launch import environment, launcher
from engine.launch.failures import PEER_FAILURE, crash_report, crash_summary

TERM = -int(signal.SIGTERM)


def _error(**codes):
    """A ChildFailedError-like error: ``{rank: exitcode}`` given as r0=..., r1=... (local rank = rank)."""
    return types.SimpleNamespace(failures={int(k[1:]): types.SimpleNamespace(exitcode=c, local_rank=int(k[1:]))
                                           for k, c in codes.items()})


def _summarize(tmp_path, error, reasons=None, interrupts=0, stderr_files=None):
    for rank, text in (reasons or {}).items():
        (tmp_path / f"rank{rank}.err").write_text(text)
    return launcher._summarize_failure(error, str(tmp_path), types.SimpleNamespace(interrupts=interrupts),
                                       stderr_files)


def test_a_second_ctrl_c_exits_130_whatever_the_ranks_said(tmp_path, capsys):
    assert launcher.ABORT_EXIT == 130
    assert _summarize(tmp_path, _error(r0=2), {0: "config error: x"}, interrupts=2) == 130
    assert capsys.readouterr().err.splitlines() == [
        "quadra: stopped at once by a second Ctrl-C (SIGINT); the same command resumes from the newest "
        "complete checkpoint"]
    assert _summarize(tmp_path, _error(r0=2), interrupts=3) == 130


@pytest.mark.parametrize("codes, status", [
    ({"r0": 2}, 2), ({"r0": 1}, 1), ({"r0": 3}, 3), ({"r0": TERM}, 1), ({"r0": -9}, 1), ({}, 1),
    ({"r0": 1, "r1": 2}, 2), ({"r0": 3, "r1": 2}, 2), ({"r0": 3, "r1": 5}, 5), ({"r0": 4, "r1": TERM}, 4),
    ({"r0": 0}, 1)])
def test_ranks_with_their_own_reason_exit_with_their_status_2_first(tmp_path, capsys, codes, status):
    """Every rank of ``codes`` wrote a reason; a signal or a missing code counts 1, and a 2 (set-up error) wins."""
    reasons = {int(k[1:]): f"training stopped: rank {k} broke\n" for k in codes} or {0: "training stopped: r0\n"}
    assert _summarize(tmp_path, _error(**codes), reasons) == status


def test_one_reason_prints_bare_and_several_print_once_with_their_ranks(tmp_path, capsys):
    assert _summarize(tmp_path, _error(r0=1, r1=1), {0: "same reason\n", 1: "same reason"}) == 1
    assert capsys.readouterr().err.splitlines() == ["same reason"]
    reasons = {0: "a", 1: "b", 2: "a", 3: PEER_FAILURE + " (x)"}
    assert _summarize(tmp_path, _error(r0=1, r1=1, r2=1, r3=TERM), reasons) == 1
    assert capsys.readouterr().err.splitlines() == ["[rank0,2] a", "[rank1] b"]


def test_only_rank_n_err_files_with_text_are_reasons(tmp_path, capsys):
    (tmp_path / "rank1.log").write_text("not a reason")
    (tmp_path / "other.err").write_text("not a reason")
    (tmp_path / "rank12.err").write_text("  \n")
    (tmp_path / "rank10.err").write_text("  set-up error: the ten  \n")
    assert _summarize(tmp_path, _error(r10=2, r12=TERM)) == 2
    assert capsys.readouterr().err.splitlines() == ["set-up error: the ten"]


def test_a_rank_that_died_without_a_reason_is_named_and_the_run_exits_1(tmp_path, capsys):
    """The SIGTERMed survivors and the ranks that gave a peer reason are collateral: not named."""
    assert _summarize(tmp_path, _error(r0=TERM, r1=-9, r2=TERM, r3=TERM), {3: PEER_FAILURE}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "quadra: rank 1 ended with signal SIGKILL (killed, out of memory, or a crash shown above); the other ranks "
        "were stopped. Rerun with QUADRA_TRACEBACK=1 for every rank's traceback"]
    assert _summarize(tmp_path, _error(r0=TERM, r1=7, r2=-9, r3=TERM), {3: PEER_FAILURE}) == 1
    err = capsys.readouterr().err
    assert [line.split(" (")[0] for line in err.splitlines()] == [
        "quadra: rank 1 ended with exit status 7", "quadra: rank 2 ended with signal SIGKILL"]


def test_with_only_collateral_the_silent_ranks_are_named_then_the_peer_reason(tmp_path, capsys):
    assert _summarize(tmp_path, _error(r0=TERM, r1=TERM, r2=TERM), {2: PEER_FAILURE + " during step 3"}) == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines[:2]] == [
        "quadra: rank 0 ended with signal SIGTERM", "quadra: rank 1 ended with signal SIGTERM"]
    assert lines[2:] == [PEER_FAILURE + " during step 3"]
    assert _summarize(tmp_path, _error(r0=TERM), {}) == 1  # no reason at all: still named
    assert capsys.readouterr().err.startswith("quadra: rank 0 ended with signal SIGTERM (killed")


CRASH = "\n".join(["free(): invalid pointer", "Fatal Python error: Aborted", "",
                   "Current thread 0x00007f (most recent call first):", '  File "/x/model.py", line 9 in forward'])


@pytest.mark.parametrize("log_ranks, shown", [("", True), ("0", False), ("1, 2", True)])
def test_a_crashed_rank_is_named_with_its_report_printed_when_its_output_was_hidden(
        tmp_path, capsys, monkeypatch, log_ranks, shown):
    monkeypatch.setenv("LOG_RANKS", log_ranks)
    stderr = tmp_path / "rank1.stderr"
    stderr.write_text("step 1\n" + CRASH + "\n")
    assert _summarize(tmp_path, _error(r0=TERM, r1=-6), stderr_files={1: str(stderr)}) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("quadra: rank 1 ended with signal SIGABRT: ")
    assert lines[-1].endswith(" (its stacks are above); the other ranks were stopped")
    assert all(line.startswith("[rank1] ") for line in lines[:-1]) and (len(lines) > 1) != shown


def test_a_crash_report_without_stacks_or_a_positive_code_reads_no_report(tmp_path, capsys):
    stderr = tmp_path / "rank0.stderr"
    stderr.write_text("malloc(): corrupted top size\nFatal Python error: Aborted\n")
    assert _summarize(tmp_path, _error(r0=-6), stderr_files={0: str(stderr)}) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("quadra: rank 0 ended with signal SIGABRT: ") and "stacks" not in line
    assert line.endswith("; the other ranks were stopped")
    assert line == f"quadra: rank 0 ended with signal SIGABRT: {crash_summary(crash_report(str(stderr)))}; the other " \
        "ranks were stopped"
    for code in (3, 0):  # an exit, not a signal: no report
        assert _summarize(tmp_path, _error(r0=code), stderr_files={0: str(stderr)}) == 1
        assert capsys.readouterr().err.startswith(f"quadra: rank 0 ended with exit status {code} (killed")
    assert _summarize(tmp_path, object(), {0: "a reason"}) == 1  # an error without failures: its reasons count


def test_the_ranks_shown_are_log_ranks_or_all(monkeypatch):
    monkeypatch.delenv("LOG_RANKS", raising=False)
    assert launcher._rank_shown(3) and launcher._rank_shown(None)
    monkeypatch.setenv("LOG_RANKS", "0, 2")
    assert launcher._rank_shown(2) and launcher._rank_shown(0) and launcher._rank_shown(None)
    assert not launcher._rank_shown(1) and not launcher._rank_shown(20)


@pytest.fixture
def handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_is_forwarded_and_said_once(handlers, monkeypatch, capsys, first):
    sent = []
    monkeypatch.setattr(launcher, "_kill_children", sent.append)
    signals = launcher._Signals()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        assert signal.getsignal(sig) == signals._handle
    signals._handle(first, None)
    signals._handle(signal.SIGTERM, None)
    assert sent == [first, signal.SIGTERM] and signals.received == first.name and signals.interrupts == 0
    assert capsys.readouterr().err.splitlines() == [
        f"quadra: received {first.name}: the ranks finish the current step, save a checkpoint (when "
        "checkpoint.enable) and exit"]


def test_the_first_ctrl_c_is_forwarded_and_the_second_kills_the_ranks(handlers, monkeypatch, capsys):
    sent = []
    monkeypatch.setattr(launcher, "_kill_children", sent.append)
    signals = launcher._Signals()
    assert (signals.interrupts, signals.received) == (0, None)
    signals._handle(signal.SIGINT, None)
    assert sent == [signal.SIGINT] and signals.interrupts == 1 and signals.received == "SIGINT"
    assert capsys.readouterr().err.strip().endswith("and exit; Ctrl-C again stops at once without saving")
    signals._handle(signal.SIGINT, None)
    assert sent == [signal.SIGINT, signal.SIGKILL] and signals.interrupts == 2
    signals._handle(signal.SIGINT, None)
    assert sent[-1] == signal.SIGKILL and capsys.readouterr().err == ""


def test_a_signal_goes_to_this_processs_children_only(monkeypatch):
    """os.kill is recorded, never called: a mutant that picks other processes (``ppid != me``) must not signal
    the machine's processes, it fails here instead."""
    sent = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(launcher.os, "kill", lambda pid, signum: sent.append((pid, signum)))
        launcher._kill_children(signal.SIGTERM)
        monkeypatch.undo()
        # The pytest process may have other children of its own (a compile worker pool, say): each
        # one signalled must be a child, and the one started here among them.
        assert (child.pid, signal.SIGTERM) in sent
        for pid, signum in sent:
            with open(f"/proc/{pid}/stat") as fh:
                assert int(fh.read().rsplit(")", 1)[1].split()[1]) == os.getpid() and signum == signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_children_are_read_from_proc_stat_whatever_their_names_and_vanishing_processes(monkeypatch):
    """proc(5): ``pid (comm) state ppid ...``, where comm may hold ``) `` (the last ')' ends it); a
    process that vanished before its stat was read, or an unreadable stat, is skipped, not the end."""
    me = os.getpid()
    stats = {"11": f"11 (evil) S 1) S {me} 1 1", "12": FileNotFoundError, "13": "", "14": f"14 (rank) S {me} 1",
             "15": "15 (other) S 1 1"}

    def fake_open(path, *args, **kwargs):
        value = stats[path.split("/")[2]]
        if isinstance(value, type):
            raise value(path)
        return io.StringIO(value)

    sent = []
    monkeypatch.setattr(launcher.os, "listdir", lambda path: ["self", *stats])
    monkeypatch.setattr(launcher, "open", fake_open, raising=False)
    monkeypatch.setattr(launcher.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    launcher._kill_children(signal.SIGUSR1)
    assert sent == [(11, signal.SIGUSR1), (14, signal.SIGUSR1)]


@pytest.mark.parametrize("name, value, number", [
    ("NGPU", "", None), ("NGPU", "3", 3), ("NGPU", " 4", 4), ("MAX_RESTARTS", "0", 0), ("NODE_RANK", "0", 0)])
def test_a_launch_number_is_read_or_defaulted(monkeypatch, name, value, number):
    monkeypatch.setenv(name, value)
    assert environment.env_int(name, None) == number


@pytest.mark.parametrize("name, value, kind", [
    ("NGPU", "0", "positive"), ("NGPU", "-2", "positive"), ("NGPU", "two", "positive"), ("NGPU", "+2", "positive"),
    ("NNODES", "1.5", "positive"), ("MAX_RESTARTS", "-1", "non-negative"), ("NODE_RANK", "x", "non-negative"),
    ("NGPU", "\u00b2", "positive")])  # a digit to isdigit, not to int
def test_a_launch_number_that_cannot_work_is_refused(monkeypatch, name, value, kind):
    monkeypatch.setenv(name, value)
    with pytest.raises(environment.LaunchError, match=rf"^{name}={value!r} must be a {kind} integer; set {name} to "
                       rf"a number or leave it unset$".replace("+", r"\+").replace(".", r"\.")):
        environment.env_int(name, 1)


@pytest.mark.parametrize("value, nodes", [("", (1, 1)), ("3", (3, 3)), ("2:4", (2, 4)), ("1:1", (1, 1))])
def test_nnodes_is_a_count_or_a_range(monkeypatch, value, nodes):
    monkeypatch.setenv("NNODES", value)
    assert environment.node_range() == nodes


@pytest.mark.parametrize("value", ["0:2", "3:2", "a:2", "2:", ":2", "-1:2"])
def test_a_node_range_that_cannot_work_is_refused(monkeypatch, value):
    monkeypatch.setenv("NNODES", value)
    with pytest.raises(environment.LaunchError, match=r"must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. NNODES=2:4$"):
        environment.node_range()


@pytest.mark.parametrize("smi, ctl, available, gpus", [
    (None, False, True, 0), ("/bin/nvidia-smi", False, True, 3), (None, True, True, 3),
    ("/bin/nvidia-smi", True, False, 0)])
def test_torch_counts_the_gpus_only_where_a_driver_is(monkeypatch, smi, ctl, available, gpus):
    import torch

    monkeypatch.setattr(environment.shutil, "which", lambda name: smi if name == "nvidia-smi" else None)
    monkeypatch.setattr(environment.os.path, "exists", lambda path: ctl and path == "/dev/nvidiactl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available if smi or ctl else 1 / 0)  # asked only there
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert environment.gpus_visible() == gpus
