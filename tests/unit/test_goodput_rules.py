"""The goodput ledger's rules (engine/observe/goodput.py's module docstring) one at a time, each against
a hand count: which files of the launch's state folder are attempts, which earlier attempts make a step
"trained again", the account of an attempt that failed before its first step, of a launch without a
launcher (no state folder), the evaluation time, the final line's wording and the launcher's share when
the last attempt failed. tests/unit/test_published_hparams.py holds the three-attempt hand count."""

from __future__ import annotations

import json

import pytest

from engine.observe import goodput
from engine.observe.goodput import AttemptLedger, append_failed_launch, ledger, read_attempts, summary_text


def _attempt(folder, attempt: int, **record) -> None:
    """``attempt-K.json`` as rank 0 writes it (AttemptLedger.save), ``record`` overriding the defaults."""
    full = {"attempt": attempt, "started_at": 0.0, "resumed_from": 0, "first_step_at": None, "last_step": 0,
            "productive_steps": 0, "productive_s": 0.0, "retrained_steps": [], "retrained_s": 0.0,
            "checkpoint_s": 0.0, "evaluation_s": 0.0, **record}
    (folder / f"attempt-{attempt}.json").write_text(json.dumps(full))


def test_only_attempt_k_json_files_are_attempts_in_attempt_order(tmp_path):
    """The launcher's agent writes attempt-K.start.json, attempt-K.end.json and restart-K.json beside
    rank 0's attempt-K.json ("restart-" is as long as "attempt-"), and ranks write rank<N>.err: only
    attempt-K.json are attempts, ordered by K as a number (attempt 10 after attempt 9)."""
    for k in range(12):
        _attempt(tmp_path, k, last_step=k)
    (tmp_path / "attempt-3.start.json").write_text(json.dumps({"attempt": 3, "started_at": 1.0}))
    (tmp_path / "attempt-2.end.json").write_text(json.dumps({"attempt": 2, "cause": "x", "failed_at": 2.0}))
    (tmp_path / "restart-5.json").write_text(json.dumps({"attempt": 5, "cause": "x", "failed_at": 2.0}))
    (tmp_path / "attempt-x.json").write_text(json.dumps({"attempt": 99}))
    (tmp_path / "rank0.err").write_text("stopped: another rank went away")
    (tmp_path / "attempt-12.json").write_text("{half a reco")  # killed while writing: unreadable, skipped
    found = read_attempts(str(tmp_path))
    assert [a["attempt"] for a in found] == list(range(12))
    assert all(set(a) >= {"last_step", "productive_s"} for a in found)
    assert read_attempts(str(tmp_path / "missing")) == [] and read_attempts(None) == [] and read_attempts("") == []


def test_steps_trained_again_are_those_up_to_the_newest_step_an_earlier_attempt_reached(tmp_path):
    """High-water mark (module docstring: "steps an earlier attempt had trained already"): attempt 2
    resumed from step 4; attempt 0 reached 9, attempt 1 reached 5; attempt 2's own file (a stale one)
    and later attempts do not count. One step trained again is a range of one."""
    _attempt(tmp_path, 0, last_step=9)
    _attempt(tmp_path, 1, last_step=5)
    _attempt(tmp_path, 2, last_step=30)
    _attempt(tmp_path, 3, last_step=40)
    assert AttemptLedger(str(tmp_path), 2, 0.0, resumed_from=4).retrained_range() == (5, 9)
    assert AttemptLedger(str(tmp_path), 1, 0.0, resumed_from=8).retrained_range() == (9, 9)
    assert AttemptLedger(str(tmp_path), 1, 0.0, resumed_from=9).retrained_range() is None
    assert AttemptLedger(str(tmp_path), 0, 0.0, resumed_from=0).retrained_range() is None
    # A record without last_step (nothing says it trained) adds no step trained again.
    (tmp_path / "attempt-0.json").write_text(json.dumps({"attempt": 0}))
    (tmp_path / "attempt-1.json").unlink()
    assert AttemptLedger(str(tmp_path), 1, 0.0, resumed_from=0).retrained_range() is None


def test_a_restart_starts_when_its_ranks_started_and_attempt_0_at_the_launch(tmp_path):
    """``startup_s`` runs from the launch for attempt 0 (even if a start file is there) and from
    attempt-K.start.json for a restart; a restart without that file falls back to the launch."""
    state = str(tmp_path)
    (tmp_path / "attempt-0.start.json").write_text(json.dumps({"attempt": 0, "started_at": 50.0}))
    (tmp_path / "attempt-2.start.json").write_text(json.dumps({"attempt": 2, "started_at": 70.0}))
    assert AttemptLedger(state, 0, 10.0, 0).record["started_at"] == 10.0
    assert AttemptLedger(state, 1, 10.0, 0).record["started_at"] == 10.0
    assert AttemptLedger(state, 2, 10.0, 0).record["started_at"] == 70.0


def test_an_attempt_that_failed_before_its_first_step(tmp_path):
    """No step: no start-up or recovery time (None), no step trained, last_step = the step it resumed
    from; the attempt record's "step" is the step it resumed from (module docstring)."""
    state = str(tmp_path)
    account = AttemptLedger(state, 0, 0.0, resumed_from=3, clock=lambda: 5.0)
    account.save()
    (tmp_path / "attempt-0.end.json").write_text(json.dumps({"attempt": 0, "cause": "rank 0 ended", "failed_at": 8.0}))
    [record], summary = ledger(state, read_attempts(state), 0.0, end_time=8.0)
    assert record == {"step": 3, "attempt": 0, "resumed_from": 3, "last_step": 3, "startup_s": None,
                      "recovery_s": None, "productive_steps": 0, "productive_s": 0.0, "retrained_steps": [],
                      "retrained_s": 0.0, "checkpoint_s": 0.0, "evaluation_s": 0.0, "wall_s": 8.0,
                      "end": "rank 0 ended"}
    assert (summary["startup_s"], summary["recovery_s"], summary["step"], summary["goodput"]) == (0.0, 0.0, 3, 0.0)


def test_a_launch_without_a_launcher_keeps_its_account_in_memory(tmp_path, monkeypatch):
    """state_dir None (a bare torchrun, whose restart count may be above 0): nothing is read or
    written, the account is the running attempt's alone. Evaluation time is neither productive nor
    step time; the first step ends start-up, later ones do not move it."""
    monkeypatch.chdir(tmp_path)
    times = iter([12.0, 13.0, 14.0])
    account = AttemptLedger(None, 1, launch_time=10.0, resumed_from=0, clock=lambda: next(times))
    assert account.retrained_range() is None
    for step in (1, 2, 3):
        account.step_started()
        account.step_done(step, 0.25)
    account.evaluation(1.5)
    account.evaluation(0.5)
    account.checkpoint(0.75)
    assert list(tmp_path.iterdir()) == []
    [record], summary = ledger(None, [account.record], 10.0, end_time=20.0)
    assert (record["attempt"], record["startup_s"], record["recovery_s"], record["wall_s"]) == (1, 2.0, None, 10.0)
    assert (record["productive_steps"], record["productive_s"], record["evaluation_s"]) == (3, 0.75, 2.0)
    assert (summary["evaluation_s"], summary["checkpoint_s"], summary["startup_s"], summary["recovery_s"]) == \
        (2.0, 0.75, 2.0, 0.0)
    assert (summary["attempts"], summary["restarts"], summary["step"]) == (1, 0, 3)
    assert summary["goodput"] == 0.75 / 10.0


def test_a_record_from_before_evaluation_time_was_kept_counts_none():
    """An attempt-K.json without ``evaluation_s`` (written before the ledger kept it) counts 0 s."""
    old = {"attempt": 0, "started_at": 0.0, "resumed_from": 0, "first_step_at": 1.0, "last_step": 2,
           "productive_steps": 2, "productive_s": 2.0, "retrained_steps": [], "retrained_s": 0.0, "checkpoint_s": 0.0}
    [record], summary = ledger(None, [old], 0.0, end_time=4.0)
    assert record["evaluation_s"] == 0.0 and summary["evaluation_s"] == 0.0
    assert summary["goodput"] == 0.5


def test_goodput_under_a_second_and_an_empty_launch():
    """Goodput = productive / wall also under 1 s of wall; a launch of no time or no attempt does not
    divide by zero and reports step 0, no attempt, no restart."""
    run = {"attempt": 0, "started_at": 0.0, "resumed_from": 0, "first_step_at": 0.1, "last_step": 1,
           "productive_steps": 1, "productive_s": 0.2, "retrained_steps": [], "retrained_s": 0.0, "checkpoint_s": 0.0}
    assert ledger(None, [run], 0.0, end_time=0.5)[1]["goodput"] == pytest.approx(0.4, rel=1e-12)
    assert ledger(None, [run], 0.0, end_time=0.0)[1]["goodput"] == pytest.approx(0.2 / 1e-9, rel=1e-12)
    records, summary = ledger(None, [], 0.0, end_time=5.0)
    assert records == [] and (summary["step"], summary["attempts"], summary["restarts"]) == (0, 0, 0)
    assert summary["goodput"] == 0.0 and summary["wall_s"] == 5.0


@pytest.mark.parametrize("restarts, again, text", [
    (0, 0, "goodput 50.0 % of 10.0 s wall (0 restarts, 0 steps trained again)"),
    (1, 1, "goodput 50.0 % of 10.0 s wall (1 restart, 1 step trained again)"),
    (2, 3, "goodput 50.0 % of 10.0 s wall (2 restarts, 3 steps trained again)")])
def test_the_final_line_counts_in_english(restarts, again, text):
    """The final line's phrase: a percentage with one decimal, the wall time, singular for one."""
    assert summary_text({"goodput": 0.5, "wall_s": 10.0, "restarts": restarts, "retrained_steps": again}) == text
    assert summary_text({"goodput": 0.71349, "wall_s": 3.04, "restarts": 1, "retrained_steps": 2}) == \
        "goodput 71.3 % of 3.0 s wall (1 restart, 2 steps trained again)"


def test_the_launcher_appends_the_ledger_of_a_launch_whose_last_attempt_failed(tmp_path, monkeypatch):
    """append_failed_launch: one "attempt" record per attempt, then the "goodput" summary, appended to
    the run folder's metrics.jsonl (earlier lines kept); the last attempt's end is "failed" when no
    end file names its cause; the wall runs to now. No run folder or no attempt: nothing written."""
    state, run = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    monkeypatch.setattr(goodput.time, "time", lambda: 40.0)
    append_failed_launch(str(state), str(run), 0.0)
    assert not (run / "metrics.jsonl").exists()
    _attempt(state, 0, first_step_at=2.0, last_step=4, productive_steps=4, productive_s=8.0)
    (state / "attempt-0.end.json").write_text(json.dumps({"attempt": 0, "cause": "rank 1 hung", "failed_at": 20.0}))
    (state / "restart-1.json").write_text(json.dumps({"attempt": 1, "cause": "rank 1 hung", "failed_at": 20.0}))
    (state / "attempt-1.start.json").write_text(json.dumps({"attempt": 1, "started_at": 25.0}))
    _attempt(state, 1, started_at=25.0, first_step_at=30.0, resumed_from=4, last_step=6, productive_steps=2,
             productive_s=4.0)
    append_failed_launch(str(state), str(tmp_path / "no-run-folder"), 0.0)
    assert not (tmp_path / "no-run-folder").exists()
    (run / "metrics.jsonl").write_text('{"kind": "step", "step": 6}\n')
    append_failed_launch(str(state), str(run), 0.0)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["step", "attempt", "attempt", "goodput"]
    assert [(r["attempt"], r["step"], r["startup_s"], r["recovery_s"], r["wall_s"], r["end"]) for r in lines[1:3]] == [
        (0, 0, 2.0, None, 20.0, "rank 1 hung"), (1, 4, 5.0, 10.0, 15.0, "failed")]
    assert {k: lines[3][k] for k in ("step", "wall_s", "productive_s", "attempts", "restarts", "goodput")} == \
        {"step": 6, "wall_s": 40.0, "productive_s": 12.0, "attempts": 2, "restarts": 1, "goodput": 0.3}
