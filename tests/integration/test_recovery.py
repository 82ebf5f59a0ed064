"""A run that keeps itself alive (engine/launch/elastic.py, engine/train/recovery.py): real faults in a
launched 2-rank run of the tiny model (a rank SIGKILLed, a rank asleep outside a collective, a rank
stopped by SIGSTOP, a node gone for good, a damaged checkpoint), each checked against one uninterrupted
run, bitwise; and a stopped rank of a 4-rank tp2 x fsdp2 run. The 2-rank stopped rank, whose restart is
timed, is in tests/integration/test_recovery_timed.py."""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.checkpoint_utils import (assert_bitwise_equal, copy_checkpoint, read_checkpoint, train_run,
                                    write_tiny_corpus)
from engine.testing.processes import free_port, run_distributed
from tests.integration.test_launch import _curve, _finish, _launch, _newest_checkpoint
from tests.training_utils import FLAVOR, REPO


STEPS, INTERVAL = 12, 4
SETTINGS = {"training.steps": STEPS, "training.seq_len": 32, "validation.enable": "false",
            "training.local_batch_size": 2, "training.global_batch_size": 8, "training.gc_freq": 0,
            "lr_scheduler.warmup_steps": 2, "metrics.log_freq": 1, "checkpoint.enable": "true",
            "checkpoint.interval": INTERVAL, "checkpoint.keep_latest_k": 0, "metrics.enable_tensorboard": "false", "job.print_config": "false",
            "comm.init_timeout_seconds": 60, "job.device": "cpu", "model.flavor": FLAVOR}
CONFIG = os.path.join(REPO, "train_configs", "debug_model.toml")


def _args(folder: str, corpus: str, **overrides) -> list[str]:
    settings = {"job.dump_folder": folder, "data.path": corpus, **SETTINGS, **overrides}
    return [f"--{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """(run folder, {step: loss}) of the uninterrupted 2-rank run (forked gloo workers, no launcher);
    its folder holds checkpoints step-4, step-8, step-12."""
    folder = str(tmp_path_factory.mktemp("reference"))
    return folder, run_distributed(train_run, 2, ["--job.config_file", CONFIG, *_args(folder, corpus)])[0]["losses"]


def _records(folder: str, kind: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _final_state(folder: str, tmp_path) -> dict:
    return read_checkpoint(os.path.join(folder, "checkpoint", f"step-{STEPS}"), str(tmp_path / "state.pt"))


def _said(out: str) -> list[str]:
    """The launcher's and rank 0's one-line reports (not the step lines)."""
    return [line for line in out.splitlines() if "quadra:" in line or line.startswith(("set-up error", "config error"))]


def test_a_killed_rank_then_a_hang_are_restarted_and_the_run_ends_as_if_never_stopped(corpus, reference, tmp_path):
    """MAX_RESTARTS=2, one run meeting two faults (one launch: each costs seconds of start-up):
    rank 1 SIGKILLed at the start of step 7 (checkpoint at 4), then, in the restarted attempt, asleep
    at the start of step 10 while rank 0 waits in the step's first all-reduce (checkpoint at 8).
    Exit 0; one line per restart saying who died how (the hang: within the timeout every rank's
    stack is on disk and the line names rank 1) and where the run resumed; losses 1-12 and the final
    state equal the uninterrupted run bitwise; the ledger shows both restarts and the steps trained again."""
    ref_folder, ref_losses = reference
    folder = str(tmp_path / "run")
    # 10 s: beyond any step of this run under a second xdist worker's load, so the test shares the cores.
    proc = _launch(_args(folder, corpus, **{"comm.hang_timeout_seconds": 10}), MAX_RESTARTS="2",
                   QUADRA_TEST_FAULT="kill:1:7,hang:1:10@1")
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    restarts = [line for line in _said(out) if "restart" in line]
    assert len(restarts) == 2 and restarts[0].endswith(
        "quadra: restart 1 of 2 after rank 1 ended with signal SIGKILL: resumed from checkpoint step-4; "
        "steps 5-6 are trained again"), out[-3000:]
    hang = restarts[1]
    assert "restart 2 of 2 after a hang: rank 0 waited over 10 s (comm.hang_timeout_seconds) in gloo:all_reduce" \
        in hang and "which rank 1 never entered" in hang and "resumed from checkpoint step-8" in hang, hang
    stacks = sorted(glob.glob(os.path.join(folder, "hangs", "attempt-1", "rank-*.txt")))
    assert [os.path.basename(p) for p in stacks] == ["rank-0.txt", "rank-1.txt"]
    with open(stacks[1]) as f:
        assert "in test_hook" in f.read()  # the sleeping rank's own stack
    assert _curve(folder) == ref_losses
    assert_bitwise_equal(_final_state(folder, tmp_path), _final_state(ref_folder, tmp_path), "final state")

    attempts, (goodput,) = _records(folder, "attempt"), _records(folder, "goodput")
    print("ledger:", *map(json.dumps, attempts), json.dumps(goodput), sep="\n")  # the closing note
    assert [a["end"] for a in attempts][0::2] == ["rank 1 ended with signal SIGKILL", "completed"], attempts
    assert "hang" in attempts[1]["end"], attempts[1]
    assert [(a["resumed_from"], a["last_step"], a["retrained_steps"]) for a in attempts] == \
        [(0, 6, []), (4, 9, [5, 6]), (8, 12, [9])]
    assert [a["productive_steps"] for a in attempts] == [6, 3, 3]
    assert all(a["recovery_s"] > a["startup_s"] > 0 for a in attempts[1:])
    assert (goodput["restarts"], goodput["retrained_steps"], goodput["productive_steps"]) == (2, 3, 12)
    assert 0 < goodput["goodput"] < 1
    assert f"goodput {100 * goodput['goodput']:.1f} % of" in out


def test_without_restarts_a_killed_rank_ends_the_job_as_before(corpus, tmp_path):
    """MAX_RESTARTS unset (0): the same kill (the OOM killer, say) ends the job in one line naming the
    rank and the signal, exit 1, no traceback, with the newest checkpoint complete for the same command
    to resume; the launcher writes the ledger. (Was also tests/integration/test_launch.py's killed-rank test, a
    SIGKILL sent from outside: the same launcher path, one launch fewer.)"""
    folder = str(tmp_path / "run")
    proc = _launch(_args(folder, corpus), QUADRA_TEST_FAULT="kill:1:7")
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    said = _said(out)
    assert len(said) == 1 and said[0].startswith("quadra: rank 1 ended with signal SIGKILL"), out[-3000:]
    # The survivor's failed collective is collateral: no rank says anything about it but INFO lines.
    assert not [line for line in out.splitlines() if line.startswith(("stopped:", "[rank")) and "INFO" not in line], \
        out[-3000:]
    assert _newest_checkpoint(folder) == INTERVAL
    assert os.path.exists(os.path.join(folder, "checkpoint", f"step-{INTERVAL}", "quadra.json"))
    (attempt,) = _records(folder, "attempt")
    assert (attempt["last_step"], attempt["end"]) == (6, "rank 1 ended with signal SIGKILL")


def test_a_crashed_rank_is_named_with_its_glibc_and_faulthandler_lines(corpus, tmp_path):
    """Rank 1 frees one malloc block twice at the start of step 2 (glibc aborts it: SIGABRT), its output
    hidden by LOG_RANKS=0: the launcher's last line names the signal, glibc's message, faulthandler's
    first line and the crashing Python frame, and prints the rank's stacks above it; the ledger's
    cause says the same."""
    folder = str(tmp_path / "run")
    proc = _launch(_args(folder, corpus, **{"training.steps": 3, "checkpoint.enable": "false"}),
                   QUADRA_TEST_FAULT="double_free:1:2", LOG_RANKS="0")
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("quadra: rank 1 ended with signal SIGABRT: free(): double free detected"), out[-3000:]
    assert "; Fatal Python error: Aborted; in _crash (engine/observe/hang.py:" in last, last
    assert "[rank1] Current thread" in out and 'in test_hook' in out, out[-3000:]
    (attempt,) = _records(folder, "attempt")
    assert attempt["end"].startswith("rank 1 ended with signal SIGABRT: free(): double free detected"), attempt


def test_an_incurable_failure_is_not_retried(corpus, reference, tmp_path):
    """The only checkpoint damaged (a flipped byte): the ranks refuse it; with a restart left the job
    still ends at once, in one line, exit 2, after one attempt."""
    folder = str(tmp_path / "run")
    copy_checkpoint(reference[0], folder, INTERVAL)
    shard = sorted(glob.glob(os.path.join(folder, "checkpoint", f"step-{INTERVAL}", "*.distcp")))[0]
    with open(shard, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = _launch(_args(folder, corpus), MAX_RESTARTS="2")
    out = _finish(proc)
    assert proc.returncode == 2, out[-3000:]
    said = _said(out)
    assert len(said) == 1 and said[0].startswith("set-up error: every checkpoint in"), out[-3000:]
    assert out.count("data.path=") == 1, "the ranks started more than once"


def test_a_node_gone_for_good_shrinks_the_group_and_keeps_the_global_batch(corpus, reference, tmp_path):
    """NNODES=1:2, two one-rank "nodes" on localhost; the second node's launcher is SIGKILLed after step
    6: the first node goes on alone (dp_shard 2 -> 1, twice the accumulation, the same global batch),
    and its losses 5-12 equal a one-rank run resumed from the reference's step-4 checkpoint."""
    folder = str(tmp_path / "run")
    env = {"NNODES": "1:2", "NGPU": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "MAX_RESTARTS": "1"}
    # Both "nodes" are 127.0.0.1, so each would host the rendezvous store if it came first: say which.
    # The dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt without a
    # heartbeat: 5 s here instead of torch's 15 s default (the shrink itself is the same).
    rdzv = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"
    first = _launch(_args(folder, corpus), **env, RDZV_CONF=f"{rdzv},is_host=1")  # stays
    second = _launch(_args(folder, corpus), **env, RDZV_CONF=f"{rdzv},is_host=0", QUADRA_TEST_FAULT="kill_node:any:7")
    out = _finish(first)
    _finish(second)
    assert first.returncode == 0 and second.returncode != 0, out[-3000:]
    layout = [line for line in _said(out) if "the group continues" in line]
    assert len(layout) == 1 and layout[0].endswith(
        "the group continues on world_size 1 (was 2): dp_shard 1 (was 2); global batch 8 sequences kept "
        "with 4 microbatches per step (was 2)"), out[-3000:]

    oracle = str(tmp_path / "oracle")
    copy_checkpoint(reference[0], oracle, INTERVAL)
    resumed = run_distributed(train_run, 1, ["--job.config_file", CONFIG, *_args(oracle, corpus)])[0]["losses"]
    curve = _curve(folder)
    assert {step: curve[step] for step in range(INTERVAL + 1, STEPS + 1)} == resumed
    assert {step: curve[step] for step in range(1, INTERVAL + 1)} == {s: reference[1][s] for s in range(1, INTERVAL + 1)}


def test_a_stopped_rank_of_a_tp2_fsdp2_run_is_named(corpus, tmp_path):
    """4 ranks, tp2 x fsdp2, rank 1 SIGSTOPped at the start of step 6: the others wait in collectives of
    two groups (rank 0 with its tp peer, ranks 2, 3 behind them); the restart line names rank 1 as stopped
    and the run ends its 8 steps."""
    folder = str(tmp_path / "run")
    proc = _launch(_args(folder, corpus, **{"comm.hang_timeout_seconds": 20, "training.steps": 8,
                                            "parallelism.tp": 2}),
                   NGPU="4", MAX_RESTARTS="1", QUADRA_TEST_FAULT="stop:1:6")
    out = _finish(proc, timeout=400)
    assert proc.returncode == 0, out[-3000:]
    (restart,) = [line for line in _said(out) if "restart" in line]
    assert "after a hang: rank 1 made no progress for 20 s (comm.hang_timeout_seconds) and wrote no record: rank 1 " \
        "was stopped (SIGSTOP: state T in /proc/<pid>/stat), so it never reached " in restart, restart
    assert "the stacks of rank 0,2,3 are in" in restart and "resumed from checkpoint step-4" in restart, restart
    assert sorted(os.listdir(os.path.join(folder, "hangs", "attempt-0"))) == [
        "rank-0.fr.json", "rank-0.txt", "rank-1.frozen", "rank-2.fr.json", "rank-2.txt", "rank-3.fr.json", "rank-3.txt"]
    assert max(_curve(folder)) == 8
