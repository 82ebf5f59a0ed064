"""The exit status of ``python -m engine.launch`` (engine/launch/launcher.py) from its entry, in-process:
the config, the pre-flight's checks and torchrun's agent are stubbed, so nothing starts
(tests/integration/test_launch.py launches for real; tests/unit/test_launcher_rules.py holds the failure summary, the
signals and the launch numbers), and torchrun's command line (engine/launch/environment.py). Oracles: the
module's docstring: a config, launch-setting or set-up problem is one line and exit 2, before anything
starts; a run that ends well exits 0, a failed one with its ranks' status (a hang: its line, 1; a second
Ctrl-C: 130); a dry run and a replica-group launch exit with their own status."""

from __future__ import annotations

import os
import signal
import types

import pytest

from engine.launch import environment, launcher

TERM = -int(signal.SIGTERM)


def _cfg(dry_run=False, ft=None, dp_shard=-1, warnings=()):
    """A stand-in for engine.config's loaded config: what main, _preflight and _launch read."""
    return types.SimpleNamespace(
        validate=lambda: None, warnings=lambda: list(warnings), run_folder="/run", comm=types.SimpleNamespace(
            hang_timeout_seconds=30.0), parallelism=types.SimpleNamespace(dp_shard=dp_shard),
        job=types.SimpleNamespace(dry_run=dry_run, device="cpu"),
        fault_tolerance=ft or types.SimpleNamespace(enable=False))


@pytest.fixture
def stubbed(monkeypatch):
    """main with the config, the pre-flight's checks and torchrun stubbed; -> the calls they saw."""
    import engine.config
    import engine.setup.preflight as preflight

    seen = types.SimpleNamespace(cfg=_cfg(), setups=[], launches=[], argv=None, problem=None)
    for name in ("NNODES", "MAX_RESTARTS", "NGPU", "QUADRA_PREFLIGHT_DONE", "LOG_RANKS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine.config, "load_config", lambda argv: setattr(seen, "argv", argv) or seen.cfg)

    def check_setup(cfg, world_size, device_type, check_data=True):
        seen.setups.append((world_size, device_type, check_data))
        if seen.problem and world_size in seen.problem:
            raise ValueError(seen.problem[world_size])
        return types.SimpleNamespace(warnings=["setup says"])

    monkeypatch.setattr(preflight, "check_setup", check_setup)
    monkeypatch.setattr(preflight, "hardware_warnings", lambda cfg, device: ["cpu says"])
    monkeypatch.setattr(launcher, "gpus_visible", lambda: 0)
    monkeypatch.setattr(launcher, "_launch", lambda *args: seen.launches.append(args) or 0)
    return seen


def test_a_launch_that_passes_its_pre_flight_exits_with_torchruns_status(stubbed, monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "3")
    monkeypatch.setenv("MAX_RESTARTS", "2")
    stubbed.cfg = _cfg(warnings=["config says"])
    monkeypatch.setattr(launcher, "_launch", lambda *args: stubbed.launches.append(args) or 7)
    assert launcher.main(["--a", "b", "--dry_run"]) == 7
    assert stubbed.argv == ["--a", "b", "--job.dry_run", "true"]
    (cfg, argv, restarts, launch_time), = stubbed.launches
    assert cfg is stubbed.cfg and restarts == 2
    assert argv[-6:] == ["-m", "engine.train", "--a", "b", "--job.dry_run", "true"]
    assert "--nproc-per-node=3" in argv and "--max-restarts=2" in argv
    assert stubbed.setups == [(3, "cpu", True)] and os.environ["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 3))
    assert abs(launch_time - __import__("time").time()) < 60
    assert capsys.readouterr().err.splitlines() == ["warning: config says", "warning: setup says", "warning: cpu says"]
    monkeypatch.setenv("QUADRA_PREFLIGHT_DONE", "1")  # a replica group: its parent said the warnings
    assert launcher.main([]) == 7 and capsys.readouterr().err == ""


@pytest.mark.parametrize("env, line", [
    ({"NGPU": "0"}, "launch error: NGPU='0' must be a positive integer"),
    ({"NNODES": "2:1"}, "launch error: NNODES='2:1' must be N or MIN:MAX"),
    ({"MAX_RESTARTS": "-1"}, "launch error: MAX_RESTARTS='-1' must be a non-negative integer"),
    ({"NNODES": "2", "NGPU": "1"}, "launch error: NNODES=2 needs MASTER_ADDR"),
    ({"NNODES": "1:2", "NGPU": "1"}, "launch error: NNODES=1:2 needs MASTER_ADDR")])
def test_a_launch_setting_that_cannot_work_is_one_line_and_exit_2(stubbed, monkeypatch, capsys, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launcher.main([]) == 2 and not stubbed.launches and not stubbed.setups
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line)


def test_a_config_error_is_one_line_and_exit_2(stubbed, monkeypatch, capsys):
    from engine.config import ConfigError

    def refuse():
        raise ConfigError("training.steps must be positive")

    stubbed.cfg.validate = refuse
    assert launcher.main([]) == 2 and not stubbed.launches
    assert capsys.readouterr().err.splitlines() == ["config error: training.steps must be positive"]


def test_a_set_up_error_is_one_line_and_exit_2(stubbed, monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "2")
    stubbed.problem = {2: "tp 4 does not divide world_size 2"}
    assert launcher.main([]) == 2 and not stubbed.launches
    assert capsys.readouterr().err.splitlines() == ["set-up error: tp 4 does not divide world_size 2"]
    stubbed.problem, stubbed.setups = None, []  # FileNotFoundError (a missing tokenizer, say) too
    monkeypatch.setattr(launcher, "_check_shrinkable", lambda *a: (_ for _ in ()).throw(FileNotFoundError("tok")))
    monkeypatch.setenv("NNODES", "1:2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert launcher.main([]) == 2 and capsys.readouterr().err.splitlines() == ["set-up error: tok"]


def test_every_node_count_of_a_range_is_checked_and_one_that_fails_is_named(stubbed, monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.setenv("NNODES", "1:3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert launcher.main([]) == 0
    assert stubbed.setups == [(6, "cpu", True), (2, "cpu", False), (4, "cpu", False)]
    stubbed.problem = {4: "ep 3 does not divide 4"}
    capsys.readouterr()
    assert launcher.main([]) == 2 and capsys.readouterr().err.splitlines() == [
        "set-up error: NNODES=1:3: on 2 nodes (world_size 4) ep 3 does not divide 4"]
    stubbed.problem = {2: "x"}
    assert launcher.main([]) == 2 and "on 1 node (world_size 2) x" in capsys.readouterr().err
    stubbed.cfg = _cfg(dp_shard=2)
    monkeypatch.setenv("NNODES", "2:3")
    assert launcher.main([]) == 2 and "shrink to 2 nodes, but" in capsys.readouterr().err


def test_a_dry_run_exits_with_its_own_status_and_starts_nothing(stubbed, monkeypatch):
    import engine.launch.dry_run as dry

    monkeypatch.setenv("NGPU", "4")
    monkeypatch.setenv("NNODES", "2")  # no MASTER_ADDR needed: no rendezvous
    monkeypatch.setattr(dry, "dry_run", lambda cfg, world, gpus_per_node: (cfg, world, gpus_per_node) == (
        stubbed.cfg, 8, 4) and 5)
    stubbed.cfg = _cfg(dry_run=True)
    assert launcher.main([]) == 5 and not stubbed.launches and not stubbed.setups


def _ft(**kw):
    return types.SimpleNamespace(**{**dict(enable=True, group_size=2, replica_id=-1, lighthouse=""), **kw})


def test_a_replica_group_launch_exits_with_the_groups_status_or_2(stubbed, monkeypatch, capsys):
    from engine.launch.replica_groups import ReplicaLaunchError

    monkeypatch.setenv("NGPU", "4")
    stubbed.cfg = _cfg(ft=_ft())
    groups = []
    monkeypatch.setattr(launcher, "launch_replica_groups", lambda cfg, argv, n, nodes: groups.append(
        (cfg is stubbed.cfg, argv, n, nodes)) or 9)
    assert launcher.main(["--x"]) == 9 and groups == [(True, ["--x"], 4, 1)] and not stubbed.launches
    assert stubbed.setups == [(2, "cpu", True)]  # the pre-flight of one group: NGPU / group_size ranks

    def refuse(*args):
        raise ReplicaLaunchError("no lighthouse")

    monkeypatch.setattr(launcher, "launch_replica_groups", refuse)
    capsys.readouterr()
    assert launcher.main([]) == 2 and capsys.readouterr().err.splitlines() == [
        "warning: setup says", "warning: cpu says", "launch error: no lighthouse"]  # after the pre-flight
    stubbed.cfg = _cfg(ft=_ft(group_size=3))  # 3 does not divide NGPU 4: refused before the pre-flight
    assert launcher.main([]) == 2 and "must divide NGPU = 4" in capsys.readouterr().err


def test_one_groups_launch_needs_a_lighthouse_unless_its_parent_started_one(stubbed, monkeypatch, capsys):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    stubbed.cfg = _cfg(ft=_ft(replica_id=1))
    assert launcher.main([]) == 2 and not stubbed.launches
    assert capsys.readouterr().err.splitlines() == [
        "launch error: fault_tolerance.replica_id = 1 needs the job's lighthouse: set fault_tolerance.lighthouse or "
        "TORCHFT_LIGHTHOUSE to http://HOST:PORT"]
    checked = []
    monkeypatch.setattr(launcher, "check_lighthouse", checked.append)
    stubbed.cfg = _cfg(ft=_ft(replica_id=1, lighthouse="http://lh:1"))
    assert launcher.main([]) == 0 and checked == ["http://lh:1"] and len(stubbed.launches) == 1
    monkeypatch.setenv("QUADRA_PREFLIGHT_DONE", "1")
    assert launcher.main([]) == 0 and checked == ["http://lh:1"] and len(stubbed.launches) == 2


@pytest.fixture
def torchrun(monkeypatch):
    """_launch with torchrun's agent (run_elastic), Recovery, the ledger and _Signals stubbed; -> what they saw."""
    import logging

    import engine.launch.elastic as elastic
    import engine.observe.goodput as goodput
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    class Failed(ChildFailedError):
        def __init__(self, failures):
            Exception.__init__(self, "failed")
            self.failures = failures

    seen = types.SimpleNamespace(failed=Failed, outcome=None, hang=None, interrupts=0, ledger=[], recovery=None)

    class Recovery:
        def __init__(self, *args, stop_requested):
            seen.recovery, self.stop_requested, self.hang = args, stop_requested, seen.hang
            self.stderr_files = {"files": 1}

    def run_elastic(argv, recovery):
        seen.argv, seen.env, seen.stop = argv, dict(os.environ), recovery.stop_requested
        seen.error_dir = os.environ["QUADRA_ERROR_DIR"]
        if seen.outcome is not None:  # an error, or a function that does what the ranks did and returns it
            raise seen.outcome() if callable(seen.outcome) else seen.outcome

    monkeypatch.setattr(elastic, "Recovery", Recovery)
    monkeypatch.setattr(elastic, "run_elastic", run_elastic)
    monkeypatch.setattr(goodput, "append_failed_launch", lambda *args: seen.ledger.append(args))
    monkeypatch.setattr(launcher, "_Signals", lambda: types.SimpleNamespace(interrupts=seen.interrupts, received=None))
    for name in ("QUADRA_ERROR_DIR", "QUADRA_LAUNCH_TIME", "QUADRA_MAX_RESTARTS", "QUADRA_LAUNCHER",
                 "TORCH_FR_BUFFER_SIZE", "QUADRA_TRACEBACK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    level = logging.getLogger("torch.distributed.elastic").level
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    yield seen
    logging.getLogger("torch.distributed.elastic").setLevel(level)


def test_a_run_that_ends_well_exits_0_and_leaves_no_error_folder(torchrun):
    assert launcher._launch(_cfg(), ["--standalone", "x"], 3, 12.5) == 0
    assert torchrun.argv == [f"--log-dir={os.path.join(torchrun.error_dir, 'ranks')}", "--redirects=2",
                             "--standalone", "x"]
    assert torchrun.recovery == (torchrun.error_dir, "/run", 3, 30.0) and torchrun.stop() is False
    assert {k: torchrun.env[k] for k in ("QUADRA_LAUNCH_TIME", "QUADRA_MAX_RESTARTS", "QUADRA_LAUNCHER")} == {
        "QUADRA_LAUNCH_TIME": "12.5", "QUADRA_MAX_RESTARTS": "3", "QUADRA_LAUNCHER": "1"}
    assert torchrun.env["TORCH_FR_BUFFER_SIZE"] and not os.path.exists(torchrun.error_dir)
    assert not torchrun.ledger and os.path.basename(torchrun.error_dir).startswith("quadra-errors-")
    import logging  # torchrun's per-rank ERROR logs are silenced: the launcher prints the reason

    assert logging.getLogger("torch.distributed.elastic").level == logging.CRITICAL


def test_a_failed_run_exits_with_the_ranks_status_and_is_in_the_ledger(torchrun, capsys):
    torchrun.outcome = torchrun.failed({0: types.SimpleNamespace(exitcode=2, local_rank=0)})

    def run():
        status = launcher._launch(_cfg(), [], 0, 7.0)
        return status, capsys.readouterr().err.splitlines()

    def write_reason():  # the rank's reason, in the error folder torchrun's ranks were given
        with open(os.path.join(os.environ["QUADRA_ERROR_DIR"], "rank0.err"), "w") as f:
            f.write("set-up error: no tokenizer")
        return torchrun.failed({0: types.SimpleNamespace(exitcode=2, local_rank=0)})

    assert run()[0] == 1  # no reason written: the rank is named, exit 1
    assert torchrun.ledger == [(torchrun.error_dir, "/run", 7.0)] and not os.path.exists(torchrun.error_dir)
    torchrun.outcome = write_reason
    assert run() == (2, ["set-up error: no tokenizer"])


def test_a_hang_is_its_line_and_exit_1_unless_ctrl_c_came_twice(torchrun, capsys):
    torchrun.outcome = torchrun.failed({0: types.SimpleNamespace(exitcode=TERM, local_rank=0)})
    torchrun.hang = "quadra: rank 1 hung"
    assert launcher._launch(_cfg(), [], 0, 0.0) == 1
    assert capsys.readouterr().err.splitlines() == ["quadra: rank 1 hung"] and len(torchrun.ledger) == 1
    torchrun.interrupts = 2
    assert launcher._launch(_cfg(), [], 0, 0.0) == 130 and len(torchrun.ledger) == 2
    assert "second Ctrl-C" in capsys.readouterr().err


def test_with_quadra_traceback_the_failure_is_raised_not_summarized(torchrun, monkeypatch):
    torchrun.outcome = torchrun.failed({0: types.SimpleNamespace(exitcode=1, local_rank=0)})
    monkeypatch.setenv("QUADRA_TRACEBACK", "1")
    with pytest.raises(torchrun.failed):
        launcher._launch(_cfg(), [], 0, 0.0)
    assert not torchrun.ledger and not os.path.exists(torchrun.error_dir)
    import logging

    assert logging.getLogger("torch.distributed.elastic").level == logging.WARNING  # torchrun's logs kept


ENTRY = ["-m", "engine.train"]
TAIL = ["--signals-to-handle=SIGHUP,SIGQUIT", *ENTRY]  # TERM, USR1 and INT are the launcher's own


@pytest.mark.parametrize("env, nnodes, restarts, launch", [
    ({}, 1, 0, ["--standalone", "--nnodes=1", "--nproc-per-node=2"]),
    ({"LOG_RANKS": "0,1"}, 1, 3, ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--local-ranks-filter=0,1"]),
    ({"MASTER_ADDR": "h", "NODE_RANK": "1"}, 2, 0, [
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=h",
        "--master-port=29500"]),
    ({"MASTER_ADDR": "h", "NODE_RANK": "0", "MASTER_PORT": "7"}, 3, 0, [
        "--nnodes=3", "--node-rank=0", "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=h",
        "--master-port=7"]),
    ({"MASTER_ADDR": "h"}, (1, 3), 1, ["--nnodes=1:3", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                      "--rdzv-endpoint=h:29500", "--rdzv-id=quadra"]),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "9", "RDZV_ID": "job", "RDZV_CONF": "last_call_timeout=10"}, (2, 4), 0, [
        "--nnodes=2:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:9", "--rdzv-id=job",
        "--rdzv-conf=last_call_timeout=10"])])
def test_torchruns_command_line_for_one_node_static_nodes_and_an_elastic_range(monkeypatch, env, nnodes, restarts,
                                                                                launch):
    for name in ("MASTER_ADDR", "NODE_RANK", "MASTER_PORT", "RDZV_ID", "RDZV_CONF", "LOG_RANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    torchrun_args = environment.torchrun_args
    args = torchrun_args(2, nnodes, ENTRY, restarts) if restarts else torchrun_args(2, nnodes, ENTRY)
    assert args == [*launch, f"--max-restarts={restarts}", *TAIL]


@pytest.mark.parametrize("env, nnodes, line", [
    ({"MASTER_ADDR": "h"}, 2, "NNODES=2 needs MASTER_ADDR (the first node's address) and NODE_RANK (this node's "
     "index, 0..1); set both on every node"),
    ({"NODE_RANK": "0"}, 3, "NNODES=3 needs MASTER_ADDR (the first node's address) and NODE_RANK (this node's "
     "index, 0..2); set both on every node"),
    ({"MASTER_ADDR": "h", "NODE_RANK": "2"}, 2, "NODE_RANK=2 must be below NNODES=2; number the nodes 0..1"),
    ({}, (1, 2), "NNODES=1:2 needs MASTER_ADDR (the address of the node that hosts the rendezvous, and must stay "
     "up); set it on every node")])
def test_a_node_setting_that_cannot_work_is_refused(monkeypatch, env, nnodes, line):
    for name in ("MASTER_ADDR", "NODE_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(environment.LaunchError) as error:
        environment.torchrun_args(2, nnodes, ENTRY)
    assert str(error.value) == line


def test_the_ranks_per_node_are_ngpu_else_the_gpus_else_2(monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    assert (environment.nproc_per_node(0), environment.nproc_per_node(4)) == (2, 4)
    monkeypatch.setenv("NGPU", "3")
    assert environment.nproc_per_node(8) == 3
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)
    monkeypatch.setattr(environment.os.path, "exists", lambda path: False)
    assert environment.gpus_visible() == 0  # no driver: torch is not asked


def test_with_gpus_the_fit_check_warns_and_the_device_is_cuda(stubbed, monkeypatch, capsys):
    import engine.launch.dry_run as dry

    import engine.setup.preflight as preflight

    monkeypatch.setattr(launcher, "gpus_visible", lambda: 3)  # NGPU unset: one rank per visible GPU
    monkeypatch.setattr(dry, "fit_warning", lambda cfg, world, gpus_per_node, setup: (
        cfg is stubbed.cfg and setup.warnings and f"fit {world} {gpus_per_node}"))
    monkeypatch.setattr(preflight, "hardware_warnings", lambda cfg, device: [f"{device} says"])
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's setting stays
    stubbed.cfg.job.device = "auto"
    assert launcher.main([]) == 0 and stubbed.setups == [(3, "cuda", True)] and os.environ["OMP_NUM_THREADS"] == "5"
    assert capsys.readouterr().err.splitlines()[-2:] == ["warning: cuda says", "warning: fit 3 3"]
    stubbed.cfg.job.device = "cpu"  # asked for: kept, GPUs or not
    assert launcher.main([]) == 0 and stubbed.setups[-1] == (3, "cpu", True) and capsys.readouterr()
    monkeypatch.setattr(dry, "fit_warning", lambda *a, **k: None)
    assert launcher.main([]) == 0 and "fit" not in capsys.readouterr().err


def test_the_defaults_cores_argv_and_the_device_a_cpu_gets(stubbed, monkeypatch):
    """MAX_RESTARTS 0, argv from sys.argv, OMP_NUM_THREADS = cores // NGPU (1 where unknown), auto -> cpu; a
    fixed layout on one node is not an elastic range; the status's inputs reach _launch."""
    monkeypatch.setattr(launcher.sys, "argv", ["engine.launch", "--y"])
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 7)
    monkeypatch.setenv("NGPU", "3")
    stubbed.cfg = _cfg(dp_shard=2)
    stubbed.cfg.job.device = "auto"
    assert launcher.main() == 0 and stubbed.argv == ["--y"] and stubbed.launches[0][2] == 0
    assert os.environ["OMP_NUM_THREADS"] == "2" and stubbed.setups == [(3, "cpu", True)]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("NGPU", "1")
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: None)
    assert launcher.main([]) == 0 and os.environ["OMP_NUM_THREADS"] == "1"


def test_the_summary_gets_the_ranks_stderr_files(torchrun, monkeypatch):
    torchrun.outcome = torchrun.failed({0: types.SimpleNamespace(exitcode=-6, local_rank=0)})
    seen = []
    monkeypatch.setattr(launcher, "_summarize_failure", lambda *args: seen.append(args) or 4)
    assert launcher._launch(_cfg(), [], 0, 0.0) == 4 and seen[0][3] == {"files": 1}
