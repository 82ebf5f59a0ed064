"""The exit status and refusals of a torchft replica-group launch (engine/launch/replica_groups.py),
in-process: the groups and the lighthouse are stand-ins, so nothing trains (tests/integration/test_fault_tolerance.py
launches the real groups). Oracles: the module's docstrings (the worst status wins: any failure over
success, then the larger magnitude; refusals are ReplicaLaunchError, printed as one line, exit 2)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import types

import pytest

from engine.launch import replica_groups as rg


def _section(**kw):
    fields = dict(enable=True, group_size=2, replica_id=-1, min_replica_size=1, lighthouse="")
    return types.SimpleNamespace(**{**fields, **kw})


class _Group:
    """A stand-in for a group's launcher process: running for its first ``running`` polls, then ended with
    ``statuses[its replica id]``."""

    made: list = []

    def __init__(self, argv, env=None, running=0):
        self.argv, self.env, self.signals, self.polls = argv, env, [], 0
        self.running = running
        self.returncode = None
        _Group.made.append(self)

    def poll(self):
        self.polls += 1
        if self.running:
            self.running -= 1
            return None
        self.returncode = _Group.statuses[int(self.argv[-1])]
        return self.returncode

    def send_signal(self, signum):
        self.signals.append(signum)


@pytest.fixture
def groups(monkeypatch):
    """Popen of run_groups returns _Group; the signal handlers it sets are put back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    _Group.made = []
    monkeypatch.setattr(rg.subprocess, "Popen", lambda argv, env=None: _Group(argv, env))
    monkeypatch.setattr(rg.time, "sleep", lambda s: None)
    yield _Group
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("statuses, worst", [
    ([0, 0], 0), ([0, 1], 1), ([1, 0], 1), ([2, 1], 2), ([1, 2], 2), ([0, -9], -9), ([-9, 2], -9),
    ([130, 0, 0], 130), ([0, 0, 3], 3), ([-15, 15], -15), ([1, -1], 1)])
def test_the_launch_exits_with_its_worst_groups_status(groups, statuses, worst):
    """Any failure beats success, then the larger magnitude (a signal -9 beats exit 2); ties keep the first."""
    groups.statuses = statuses
    assert rg.run_groups(_section(group_size=len(statuses)), ["--x", "1"], 3, "http://h:1") == worst
    assert len(groups.made) == len(statuses)


def test_each_group_is_a_launch_with_its_replica_id_its_ranks_and_the_lighthouse(groups, monkeypatch):
    monkeypatch.delenv("RUST_LOG", raising=False)
    monkeypatch.setenv("QUADRA_KEEP", "yes")
    groups.statuses = [0, 0, 0]
    rg.run_groups(_section(group_size=3), ["--training.steps", "4"], 2, "http://lh:29510")
    for g, group in enumerate(groups.made):
        assert group.argv == [sys.executable, "-m", "engine.launch", "--training.steps", "4",
                              "--fault_tolerance.replica_id", str(g)]
        assert {k: group.env[k] for k in ("NGPU", rg.LIGHTHOUSE_ENV, "QUADRA_PREFLIGHT_DONE", "QUADRA_REPLICA_ID",
                                          "RUST_LOG", "QUADRA_KEEP")} == {
            "NGPU": "2", rg.LIGHTHOUSE_ENV: "http://lh:29510", "QUADRA_PREFLIGHT_DONE": "1",
            "QUADRA_REPLICA_ID": str(g), "RUST_LOG": "warn", "QUADRA_KEEP": "yes"}
    monkeypatch.setenv("RUST_LOG", "debug")  # the user's RUST_LOG wins over the default
    groups.made = []
    rg.run_groups(_section(group_size=3), [], 2, "http://lh:29510")
    assert {group.env["RUST_LOG"] for group in groups.made} == {"debug"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_goes_to_every_group_still_running(groups, monkeypatch, sig):
    groups.statuses = [0, 0]
    monkeypatch.setattr(rg.subprocess, "Popen", lambda argv, env=None: _Group(argv, env, running=2 * (argv[-1] == "1")))
    forwarded = []

    def sleep(seconds):  # the wait loop's sleep: deliver the signal while group 1 runs
        forwarded.append(seconds)
        signal.getsignal(sig)(sig, None)

    monkeypatch.setattr(rg.time, "sleep", sleep)
    assert rg.run_groups(_section(), [], 1, "http://h:1") == 0
    assert forwarded == [0.5]
    assert [g.signals for g in groups.made] == [[], [sig]]  # group 0 had ended: not signalled


def test_a_lighthouse_that_ends_is_said_once_and_the_groups_still_decide(groups, monkeypatch, capsys):
    groups.statuses = [0, 1]
    monkeypatch.setattr(rg.subprocess, "Popen", lambda argv, env=None: _Group(argv, env, running=1))
    lighthouse = types.SimpleNamespace(poll=lambda: 3, returncode=3)
    assert rg.run_groups(_section(), [], 1, "http://h:1", lighthouse) == 1
    assert capsys.readouterr().err.splitlines() == [
        "quadra: the torchft lighthouse ended with status 3 (its output: lighthouse.log in the run folder); "
        "the groups fail at their next quorum"]
    alive = types.SimpleNamespace(poll=lambda: None, returncode=None)
    assert rg.run_groups(_section(), [], 1, "http://h:1", alive) == 1
    assert capsys.readouterr().err == ""


def test_the_ranks_per_group_and_the_refusals():
    assert rg.group_arguments(_section(group_size=2), 4, 1) == 2
    assert rg.group_arguments(_section(group_size=3), 3, 1) == 1
    with pytest.raises(rg.ReplicaLaunchError, match=r"^fault_tolerance.replica_id = -1 starts every group on this "
                       r"node; with NNODES=2 start one group per launch: --fault_tolerance.replica_id N and "
                       r"TORCHFT_LIGHTHOUSE=http://HOST:PORT on every node of group N$"):
        rg.group_arguments(_section(), 4, 2)
    with pytest.raises(rg.ReplicaLaunchError, match=r"^fault_tolerance.group_size = 3 must divide NGPU = 4 \(each "
                       r"group gets NGPU / group_size ranks\); set NGPU to a multiple of it$"):
        rg.group_arguments(_section(group_size=3), 4, 1)


def test_the_lighthouse_is_the_configs_else_the_environments(monkeypatch):
    monkeypatch.delenv(rg.LIGHTHOUSE_ENV, raising=False)
    assert rg.lighthouse_address(_section()) == ""
    monkeypatch.setenv(rg.LIGHTHOUSE_ENV, "http://env:1")
    assert rg.lighthouse_address(_section()) == "http://env:1"
    assert rg.lighthouse_address(_section(lighthouse="http://cfg:2")) == "http://cfg:2"


def test_a_lighthouse_answers_or_is_refused_in_one_line():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        rg.check_lighthouse(f"http://127.0.0.1:{port}", timeout_s=0)
        rg.check_lighthouse(f"127.0.0.1:{port}", timeout_s=0)  # no scheme: http
    for bad in ("http://127.0.0.1", "http://:80", "nohost"):
        with pytest.raises(rg.ReplicaLaunchError, match=r"must be http://HOST:PORT \(or set TORCHFT_LIGHTHOUSE\)$"):
            rg.check_lighthouse(bad, timeout_s=0)
    with pytest.raises(rg.ReplicaLaunchError, match=rf"^fault_tolerance.lighthouse = 'http://127.0.0.1:{port}': no "
                       rf"lighthouse answers there; start one \(torchft_lighthouse --min_replicas 1 --bind "
                       rf"\[::\]:{port}\) or, on one node, leave the address and TORCHFT_LIGHTHOUSE empty"):
        rg.check_lighthouse(f"http://127.0.0.1:{port}", timeout_s=0)


def test_a_lighthouse_that_starts_late_is_waited_for_until_the_timeout(monkeypatch):
    """Connection refused twice, then it answers: accepted within the timeout, retried every 0.2 s."""
    tries, sleeps = [], []

    def connect(address, timeout):
        tries.append((address, timeout))
        if len(tries) < 3:
            raise ConnectionRefusedError
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(rg.socket, "create_connection", connect)
    monkeypatch.setattr(rg.time, "sleep", sleeps.append)
    rg.check_lighthouse("http://lh:7", timeout_s=60)
    assert tries == [(("lh", 7), 1.0)] * 3 and sleeps == [0.2, 0.2]


def _fake_lighthouse(folder):
    """A torchft_lighthouse that prints its arguments, whether it leads a session of its own, a stderr line."""
    fake = folder / "torchft_lighthouse"
    folder.mkdir(parents=True, exist_ok=True)
    fake.write_text('#!/bin/sh\necho "$@"\nread -r stat < /proc/$$/stat\nset -- $stat\n'  # shell built-ins only
                    '[ "$1" = "$6" ] && echo own-session || echo launchers-session\necho its-stderr >&2\n')
    fake.chmod(0o755)
    return fake


def _printed(process, log):
    assert process.wait(timeout=10) == 0
    return log.read_text().split()


def test_the_lighthouse_process_its_flags_and_its_log(monkeypatch, tmp_path):
    fake = _fake_lighthouse(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "run" / "lighthouse.log"
    process, address = rg.start_lighthouse(3, str(log), join_timeout_ms=700)
    port = int(address.rsplit(":", 1)[1])
    assert address == f"http://{socket.gethostname()}:{port}"
    assert _printed(process, log) == ["--min_replicas", "3", "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
                                      "--join_timeout_ms", "700", "--heartbeat_timeout_ms", "5000", "own-session",
                                      "its-stderr"]
    log.unlink()  # the folder is there now: a second start reuses it; a quorum waits 1 s by default
    process, address = rg.start_lighthouse(1, str(log))
    assert _printed(process, log)[7] == "1000"
    monkeypatch.chdir(tmp_path / "run")  # a log without a folder: nothing is made beside it
    process, _ = rg.start_lighthouse(1, "here.log")
    _printed(process, tmp_path / "run" / "here.log")
    assert sorted(os.listdir(tmp_path / "run")) == ["here.log", "lighthouse.log"]


def test_the_lighthouse_beside_python_is_found_else_refused(monkeypatch, tmp_path):
    fake = _fake_lighthouse(tmp_path / "venv" / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    monkeypatch.setattr(rg.sys, "executable", str(fake.parent / "python"))
    process, _ = rg.start_lighthouse(1, str(tmp_path / "lh.log"))
    assert _printed(process, tmp_path / "lh.log")[:2] == ["--min_replicas", "1"]
    monkeypatch.setattr(rg.sys, "executable", str(tmp_path / "none" / "python"))
    with pytest.raises(rg.ReplicaLaunchError, match="torchft_lighthouse is not found; install torchft with pip"):
        rg.start_lighthouse(1, str(tmp_path / "x.log"))


def test_a_lighthouse_is_waited_for_5_s_by_default(monkeypatch):
    """The deadline is 5 s after the first try; a try that fails past it (not at it) ends the wait."""
    clock, tries = iter([0.0, 5.0, 5.01, 100.0]), []

    def refused(*args, **kwargs):
        tries.append(args)
        raise ConnectionRefusedError

    monkeypatch.setattr(rg.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(rg.time, "sleep", lambda s: None)
    monkeypatch.setattr(rg.socket, "create_connection", refused)
    with pytest.raises(rg.ReplicaLaunchError, match="no lighthouse answers there"):
        rg.check_lighthouse("http://lh:7")
    assert len(tries) == 2


@pytest.mark.parametrize("named", [True, False])
def test_a_launch_of_every_group_returns_their_status_and_stops_its_lighthouse(monkeypatch, capsys, named):
    calls = []
    lighthouse = types.SimpleNamespace(terminate=lambda: calls.append("terminate"), wait=lambda: calls.append("wait"))
    monkeypatch.setattr(rg, "check_lighthouse", lambda address: calls.append(("check", address)))
    monkeypatch.setattr(rg, "start_lighthouse",
                        lambda n, log: calls.append(("start", n, log)) or (lighthouse, "http://mine:5"))
    monkeypatch.setattr(rg, "run_groups", lambda section, argv, per_group, address, lh: calls.append(
        ("run", argv, per_group, address, lh)) or (7 if section is cfg.fault_tolerance else None))
    monkeypatch.delenv(rg.LIGHTHOUSE_ENV, raising=False)
    section = _section(group_size=2, min_replica_size=2, lighthouse="http://given:9" if named else "")
    cfg = types.SimpleNamespace(fault_tolerance=section, run_folder="/rf")
    assert rg.launch_replica_groups(cfg, ["--a"], 4, 1) == 7
    if named:
        assert calls == [("check", "http://given:9"), ("run", ["--a"], 2, "http://given:9", None)]
        assert capsys.readouterr().err == ""
    else:
        assert calls == [("start", 2, "/rf/lighthouse.log"), ("run", ["--a"], 2, "http://mine:5", lighthouse),
                         "terminate", "wait"]
        assert capsys.readouterr().err == ("quadra: torchft lighthouse at http://mine:5 (min_replicas 2); "
                                           "2 replica groups of 2 ranks\n")
        calls.clear()  # a launch that fails still stops the lighthouse it started
        monkeypatch.setattr(rg, "run_groups", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            rg.launch_replica_groups(cfg, [], 4, 1)
        assert calls[-2:] == ["terminate", "wait"]


def test_a_free_port_can_be_bound():
    port = rg._free_port()
    with socket.socket() as s:
        s.bind(("", port))
    assert 1024 <= port <= 65535
