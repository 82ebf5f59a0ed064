"""The goodput ledger: where the wall time of a launch went, per attempt.

Goodput is the share of wall time that trained the model (Llama 3 reports "effective training time"
above 90 % over 466 interruptions: Dubey et al. 2024, arXiv 2407.21783, section 3.3.4). One launch
(one ``run_train.sh``) runs one or more attempts (torchrun restarts, engine/launch/elastic.py). Per
attempt the ledger has, in seconds:

- ``startup_s``: from the attempt's start (the launch for attempt 0, the start of its ranks for a
  restart) to its first step;
- ``recovery_s`` (restarts): from the failure that ended the attempt before to this one's first step;
- ``productive_s`` / ``productive_steps``: steps trained for the first time in this launch;
- ``retrained_steps`` / ``retrained_s``: steps an earlier attempt had trained already and a restart
  trained again (those after its newest checkpoint);
- ``checkpoint_s``: time the loop stood still for checkpoint saves;
- ``evaluation_s``: time the loop spent evaluating between steps (validation loss and the ``[eval]``
  downstream tasks), which is neither step time nor productive;
- ``wall_s`` and ``end`` (``completed``, ``stopped``, or the cause of the failure).

Goodput = Σ productive_s / the launch's wall time. Rank 0 keeps its attempt's running totals in the
launch's state folder (``$QUADRA_ERROR_DIR/attempt-K.json``, rewritten after every step, so an attempt
killed at any moment leaves its account); the launcher's agent adds ``attempt-K.start.json`` and, for a
failed attempt, ``attempt-K.end.json``. At the end, rank 0 (or, when the last attempt failed, the
launcher) turns them into metrics.jsonl records: one ``"attempt"`` record per attempt (``step``: the
step it resumed from) and one ``"goodput"`` record. Torch-free.
"""

from __future__ import annotations

import json
import os
import time


def read_json_record(path: str) -> dict | None:
    """The JSON object in ``path`` (a run's state record), or None when it is missing or unreadable:
    a record another attempt was still writing, or never wrote, reads as absent."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class AttemptLedger:
    """Rank 0's account of the running attempt (module docstring).

    Args:
        state_dir: the launch's state folder (``QUADRA_ERROR_DIR``), or None (no launcher: the
            account stays in memory).
        attempt: this attempt's number (``TORCHELASTIC_RESTART_COUNT``).
        launch_time: the launch's start (Unix seconds, ``QUADRA_LAUNCH_TIME``): attempt 0 starts there.
        resumed_from: the step this attempt resumed from (0: a fresh start).
        clock: the time source (Unix seconds).
    """

    def __init__(self, state_dir: str | None, attempt: int, launch_time: float, resumed_from: int, clock=time.time):
        self.state_dir, self.clock = state_dir, clock
        # (the "if state_dir" only spares a call: read_attempts(None) is [] too)
        earlier = [a for a in read_attempts(state_dir) if a["attempt"] < attempt] if state_dir else []
        # Steps up to the newest an earlier attempt reached are trained again.
        self.high_water = max([a.get("last_step", 0) for a in earlier] + [resumed_from])
        start = read_json_record(os.path.join(state_dir, f"attempt-{attempt}.start.json")) if state_dir else None
        started_at = launch_time if attempt == 0 or start is None else start["started_at"]
        self.record = {"attempt": attempt, "started_at": started_at, "resumed_from": resumed_from,
                       "first_step_at": None, "last_step": resumed_from, "productive_steps": 0,
                       "productive_s": 0.0, "retrained_steps": [], "retrained_s": 0.0, "checkpoint_s": 0.0,
                       "evaluation_s": 0.0}

    def step_started(self) -> None:
        """A step begins (the first one ends start-up)."""
        if self.record["first_step_at"] is None:
            self.record["first_step_at"] = self.clock()

    def step_done(self, step: int, seconds: float) -> None:
        """Step ``step`` took ``seconds`` (the step itself: data, forward/backward, optimizer)."""
        if step <= self.high_water:
            self.record["retrained_steps"].append(step)
            self.record["retrained_s"] += seconds
        else:
            self.record["productive_steps"] += 1
            self.record["productive_s"] += seconds
        self.record["last_step"] = step
        self.save()

    def checkpoint(self, seconds: float) -> None:
        """The loop stood still ``seconds`` for a checkpoint save."""
        self.record["checkpoint_s"] += seconds

    def evaluation(self, seconds: float) -> None:
        """The loop spent ``seconds`` evaluating (validation, downstream tasks) between steps."""
        self.record["evaluation_s"] += seconds

    def save(self) -> None:
        """Rewrite ``attempt-K.json`` (atomic); no-op without a state folder."""
        if self.state_dir:
            _write(os.path.join(self.state_dir, f"attempt-{self.record['attempt']}.json"), self.record)

    def retrained_range(self) -> tuple[int, int] | None:
        """(first, last) step this attempt trains again, known at its start; None when none."""
        first = self.record["resumed_from"] + 1
        return (first, self.high_water) if self.high_water >= first else None


def read_attempts(state_dir: str | None) -> list[dict]:
    """Every attempt's running totals in ``state_dir``, by attempt number."""
    if not state_dir or not os.path.isdir(state_dir):
        return []
    found = []
    for name in os.listdir(state_dir):
        # (any non-digit string would do for "": it only has to fail isdigit)
        stem = name[len("attempt-"):-len(".json")] if name.startswith("attempt-") and name.endswith(".json") else ""
        if stem.isdigit():
            record = read_json_record(os.path.join(state_dir, name))
            if record:
                found.append(record)
    return sorted(found, key=lambda a: a["attempt"])


def ledger(state_dir: str | None, attempts: list[dict], launch_time: float, end_time: float,
           end: str = "completed") -> tuple[list[dict], dict]:
    """(one record per attempt, the launch's summary) from the running totals ``attempts``.

    ``end`` is how the last attempt ended when no ``attempt-K.end.json`` says otherwise."""
    records = []
    totals = {"productive_s": 0.0, "retrained_s": 0.0, "checkpoint_s": 0.0, "evaluation_s": 0.0,
              "startup_s": 0.0, "recovery_s": 0.0, "retrained_steps": 0, "productive_steps": 0}
    for a in attempts:
        k = a["attempt"]
        finish = read_json_record(os.path.join(state_dir, f"attempt-{k}.end.json")) if state_dir else None
        # (k > 0 or k >= 0 alike: the agent writes restart-K.json for K >= 1 only, engine/launch/elastic.py)
        restart = read_json_record(os.path.join(state_dir, f"restart-{k}.json")) if state_dir and k > 0 else None
        first = a.get("first_step_at")
        ended = finish["failed_at"] if finish else end_time
        record = {"step": a["resumed_from"], "attempt": k, "resumed_from": a["resumed_from"],
                  "last_step": a["last_step"],
                  "startup_s": None if first is None else first - a["started_at"],
                  "recovery_s": None if restart is None or first is None else first - restart["failed_at"],
                  "productive_steps": a["productive_steps"], "productive_s": a["productive_s"],
                  "retrained_steps": a["retrained_steps"], "retrained_s": a["retrained_s"],
                  "checkpoint_s": a["checkpoint_s"], "evaluation_s": a.get("evaluation_s", 0.0),
                  "wall_s": ended - a["started_at"],
                  "end": finish["cause"] if finish else end}
        records.append(record)
        for key in ("productive_s", "retrained_s", "checkpoint_s", "evaluation_s", "productive_steps"):
            totals[key] += record[key]
        totals["retrained_steps"] += len(record["retrained_steps"])
        totals["startup_s"] += record["startup_s"] or 0.0
        totals["recovery_s"] += record["recovery_s"] or 0.0
    wall = max(end_time - launch_time, 1e-9)
    summary = {"step": attempts[-1]["last_step"] if attempts else 0, "wall_s": wall, **totals,
               "goodput": totals["productive_s"] / wall, "attempts": len(attempts),
               "restarts": max(len(attempts) - 1, 0)}
    return records, summary


def summary_text(summary: dict) -> str:
    """``goodput 71.3 % (1 restart, 2 steps trained again)`` for the final line."""
    restarts = summary["restarts"]
    again = summary["retrained_steps"]
    return (f"goodput {100 * summary['goodput']:.1f} % of {summary['wall_s']:.1f} s wall "
            f"({restarts} restart{'s' * (restarts != 1)}, {again} step{'s' * (again != 1)} trained again)")


def append_failed_launch(state_dir: str, run_folder: str, launch_time: float) -> None:
    """The launcher's share when the last attempt failed (rank 0 wrote nothing at the end): append
    the attempt records and the summary to ``<run folder>/metrics.jsonl``."""
    attempts = read_attempts(state_dir)
    if not attempts or not os.path.isdir(run_folder):
        return
    records, summary = ledger(state_dir, attempts, launch_time, time.time(), end="failed")
    # (the encoding does not matter: json.dumps writes ASCII, ensure_ascii being its default)
    with open(os.path.join(run_folder, "metrics.jsonl"), "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({"kind": "attempt", **record}) + "\n")
        f.write(json.dumps({"kind": "goodput", **summary}) + "\n")
