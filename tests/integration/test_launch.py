"""./run_train.sh as a production launcher: stop signals however they are delivered, Ctrl-C, and two
"nodes" on one machine. Every run here trains the same 2-rank FSDP job on a tiny corpus, and every
curve, however often stopped and resumed, must equal one uninterrupted run bitwise."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

import pytest

from tests.checkpoint_utils import train_run, write_tiny_corpus
from engine.testing.processes import free_port, run_distributed
from tests.training_utils import FLAVOR, REPO


STEPS = 20  # room for five stopped launches of about three steps each
SETTINGS = {"training.steps": STEPS, "training.seq_len": 32, "validation.enable": "false",
            "training.local_batch_size": 2, "training.global_batch_size": 8, "training.gc_freq": 0,
            "lr_scheduler.warmup_steps": 2, "metrics.log_freq": 1, "checkpoint.interval": 100,
            "job.print_config": "false", "comm.init_timeout_seconds": 60, "job.device": "cpu",
            "model.flavor": FLAVOR}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """{step: loss} of the uninterrupted 2-rank run (forked gloo workers, no launcher)."""
    config = os.path.join(REPO, "train_configs", "debug_model.toml")
    args = ["--job.config_file", config, *_args(str(tmp_path_factory.mktemp("reference")), corpus)]
    return run_distributed(train_run, 2, args)[0]["losses"]


def _args(folder: str, corpus: str) -> list[str]:
    return [f"--{k}={v}" for k, v in {"job.dump_folder": folder, "data.path": corpus, **SETTINGS}.items()]


def _launch(args: list[str], **env) -> subprocess.Popen:
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", **env}
    env.pop("CONFIG_FILE", None)
    # A session of its own: the test can signal the whole process group, as scancel or a terminal does.
    return subprocess.Popen([os.path.join(REPO, "run_train.sh"), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _train_records(folder: str) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == "train"]


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_train.sh did not finish:\n{out[-3000:]}")
    return out


def _ranks_of(launcher_pid: int) -> list[int]:
    """PIDs of the training ranks: the launcher's children (run_train.sh execs the launcher)."""
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                    ranks.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return ranks


def _deliver(proc: subprocess.Popen, sig: int, to: str) -> None:
    if to == "script":  # kill <pid>, a container runtime stopping its main process
        os.kill(proc.pid, sig)
    elif to == "group":  # kill -- -<pgid>, scancel, Ctrl-C in a terminal
        os.killpg(proc.pid, sig)
    elif to == "ranks":  # a runtime or scheduler that signals every process of the job but the launcher
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 2, f"expected 2 ranks under the launcher, found {ranks}"
        for pid in ranks:
            os.kill(pid, sig)


def _stop_after_two_more_steps(proc: subprocess.Popen, folder: str, signals: list[tuple[int, str]]) -> None:
    """Wait until the run has trained two more steps than before, then deliver ``signals``."""
    start = len(_train_records(folder))
    deadline = time.monotonic() + 180
    while len(_train_records(folder)) < start + 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    for sig, to in signals:
        _deliver(proc, sig, to)
        time.sleep(0.1)  # apart, so the launcher sees two presses, yet before the ranks could save


def _curve(folder: str) -> dict[int, float]:
    """{step: loss}, the last record of each step (a step redone after an abort counts once)."""
    return {r["step"]: r["loss"] for r in _train_records(folder)}


def _newest_checkpoint(folder: str) -> int:
    steps = [int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(folder, "checkpoint", "step-*"))
             if not p.endswith(".tmp")]
    return max(steps, default=0)


# One chain of launches of the same command, each stopped another way:
STOPS = [
    (signal.SIGTERM, "group"),  # SIGTERM to the process group (scancel, a container runtime)
    (signal.SIGUSR1, "script"),  # SIGUSR1 to the script (SLURM's --signal=USR1@120)
    (signal.SIGTERM, "ranks"),  # SIGTERM to every rank but not the launcher
    (signal.SIGINT, "group"),  # Ctrl-C once: stop and save, like SIGTERM
    ((signal.SIGINT, signal.SIGINT), "group"),  # Ctrl-C twice: abort at once (exit 130), resumable
]


def test_stop_signals_save_exit_0_and_the_same_command_continues_bitwise(corpus, reference, tmp_path):
    folder = str(tmp_path / "run")
    args = _args(folder, corpus)
    for sigs, to in STOPS:
        sigs = sigs if isinstance(sigs, tuple) else (sigs,)
        proc = _launch(args)
        _stop_after_two_more_steps(proc, folder, [(sig, to) for sig in sigs])
        out = _finish(proc)
        assert "Traceback" not in out, out[-3000:]
        stopped_at = _train_records(folder)[-1]["step"]
        assert stopped_at < STEPS, "the run ended before the signal arrived"
        if to != "ranks":  # the launcher says at once what the signal does
            assert f"quadra: received {signal.Signals(sigs[0]).name}: the ranks finish the current step" in out, out[-3000:]
        if len(sigs) == 2:  # the second Ctrl-C: no save, one line, the newest checkpoint stays
            assert proc.returncode == 130, out[-3000:]
            assert out.strip().splitlines()[-1].startswith("quadra: stopped at once by a second Ctrl-C"), out[-2000:]
        else:
            name = signal.Signals(sigs[0]).name
            assert proc.returncode == 0, out[-3000:]
            assert out.strip().splitlines()[-1].endswith(
                f"received {name}: saved checkpoint step-{stopped_at}, exiting"), out[-2000:]
            assert _newest_checkpoint(folder) == stopped_at

    proc = _launch(args)  # the same command once more: runs to the end
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert _curve(folder) == reference  # every step, bitwise, as if never stopped
    # Steps an aborted launch logged and the resumed one trained again are in metrics.jsonl once.
    assert [r["step"] for r in _train_records(folder)] == list(range(1, STEPS + 1))

    # TensorBoard: each launch appends an events file in the same folder; together one curve (the
    # resumed launch purges the steps an aborted one logged after its last checkpoint).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(glob.glob(os.path.join(folder, "tb", "events.out.tfevents.*"))) == len(STOPS) + 1
    events = EventAccumulator(os.path.join(folder, "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))


def test_two_nodes_on_one_machine_train_like_one_node(corpus, reference, tmp_path):
    """NNODES=2 × NGPU=1 through the static rendezvous on 127.0.0.1 = the 2-rank run; NODE_RANK
    decides the global rank (node 1 logs as rank 1)."""
    folder = str(tmp_path / "two_nodes")
    port = str(free_port())
    nodes = [_launch([*_args(folder, corpus), "--checkpoint.enable", "false", "--metrics.log_all_ranks", "true"],
                     NNODES="2", NGPU="1", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
             for node in (1, 0)]  # node 1 first: its rank must not depend on arrival order
    outs = [_finish(proc) for proc in nodes]
    assert [proc.returncode for proc in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "[rank1] " in outs[0] and "[rank0] " not in outs[0], outs[0][-2000:]
    assert _curve(folder) == reference


def test_ranks_do_not_outlive_a_launcher_killed_hard(corpus, tmp_path):
    """SIGKILL to the launcher's process group (timeout -s KILL, an OOM kill of the launcher): torchrun
    starts the ranks in sessions of their own, so they must end with their parent."""
    folder = str(tmp_path / "run")
    proc = _launch([*_args(folder, corpus), "--training.steps", "1000"])  # far from done when killed
    _stop_after_two_more_steps(proc, folder, [])
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)  # the launcher; its output pipe stays open while any rank lives
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not alive, "ranks kept running after their launcher was killed"


def test_a_rank_with_its_reason_ended_by_sigterm_exits_1_not_241(tmp_path, capsys):
    """Rank 0 wrote its one-line reason, then torchrun's SIGTERM ended it (exit code -15): the launcher
    returns 1 with the reason (it returned -15, which os._exit turned into status 241)."""
    import types

    from engine.launch.launcher import _summarize_failure

    (tmp_path / "rank0.err").write_text("training stopped: metrics after step 3 failed (PermissionError: x)\n")
    error = types.SimpleNamespace(failures={0: types.SimpleNamespace(exitcode=-int(signal.SIGTERM)),
                                            1: types.SimpleNamespace(exitcode=-int(signal.SIGTERM))})
    assert _summarize_failure(error, str(tmp_path), types.SimpleNamespace(interrupts=0)) == 1
    assert "metrics after step 3 failed" in capsys.readouterr().err
