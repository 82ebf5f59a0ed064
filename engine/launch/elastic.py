"""Restarts and hang reports on torchrun's own elastic agent (torch.distributed.elastic).

torchrun's ``LocalElasticAgent`` starts the ranks of this node, watches them and, with
``--max-restarts=N``, stops the survivors of a failed attempt and starts the whole group again, up to
N times, after a new rendezvous (with ``--nnodes=MIN:MAX`` and the c10d rendezvous the group re-forms
with the nodes that are left). Quadra adds, in :class:`QuadraAgent` (a subclass of it, the extension
point torchelastic documents: "Customization", docs.pytorch.org/docs/stable/elastic/customization.html):

- **incurable failures are not retried.** A rank that knows why it failed writes its one-line reason
  to ``$QUADRA_ERROR_DIR/rank<N>.err`` (engine/train/main.py: a refused config, a damaged
  checkpoint with no earlier one, a non-finite loss under ``stop``, a checkpoint folder that cannot
  be written). A restart would fail the same way, so the agent then spends no restart: it sets its
  remaining restarts to 0 and torchrun ends the job as without restarts. Deaths without a reason (a
  signal, a crash, a lost peer, a hang) are retried while restarts remain.
- **each attempt is told why it runs.** Before a restart the agent writes ``restart-<K>.json``
  (attempt K, the failed rank and how it ended, the time) to the same folder; rank 0 of attempt K
  says it in one line together with the step it resumed from (engine/train/recovery.py), and the
  goodput ledger reads the times (engine/observe/goodput.py).
- **a crashed rank's last words are kept.** The launcher has torchrun write each rank's stderr to a
  file (``--redirects 2``); the agent shows it as it grows, without a prefix, as if it were the
  terminal (:class:`StderrTail`), and the failure's cause carries the crashed rank's glibc and
  faulthandler lines (engine/launch/failures.py :func:`crash_report`).
- **hangs are named.** A rank whose watchdog fired (engine/observe/hang.py) exits with
  :data:`HANG_EXIT` after writing its stack and torch's Flight Recorder record to
  ``<run folder>/hangs/attempt-K/``; the agent waits for every rank's record and names the ranks that
  never entered the collective the others waited in. A rank that cannot write one (stopped: SIGSTOP, a
  debugger) is marked by the agent as soon as another rank's record is there, so nobody waits for it,
  and SIGKILLed then (torchrun's SIGTERM would wait 30 s on it); a rank frozen otherwise, once the
  others stop waiting; both are named in the line (engine/launch/frozen.py).

torchrun builds its agent inside ``torch.distributed.launcher.api.launch_agent``; :func:`run_elastic`
lets that function build a :class:`QuadraAgent` instead, and keeps everything else of torchrun
(rendezvous, ``TORCHELASTIC_RESTART_COUNT``, signals, log handling).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from engine.launch.failures import crash_report, crash_summary, failure_cause, incurable, read_reasons
from engine.launch.frozen import await_hang_records, hang_verdict, kill_silent, proc_state, settle_hang
from engine.observe.hang import HANG_EXIT, hang_folder


class Recovery:
    """What the agent and the launcher share about one launch: the folders, the restart budget, the
    cause of the last failure (``last_cause``; ``hang``: it was a hang, one line to print) and the
    stderr file of each rank of this node in the current attempt (``stderr_files``: {global rank: path})."""

    def __init__(self, error_dir: str, run_folder: str, max_restarts: int, hang_timeout_s: float,
                 stop_requested=lambda: False):
        self.error_dir, self.run_folder = error_dir, run_folder
        self.max_restarts, self.hang_timeout_s = max_restarts, hang_timeout_s
        self.stop_requested = stop_requested
        self.last_cause: str | None = None
        self.hang: str | None = None
        self.stderr_files: dict[int, str] = {}
        self.silent: dict[int, str] = {}  # {global rank: /proc state} of this node's ranks found stopped or
        # SIGKILLed without a record of their own, in the current attempt

    def watch(self, attempt: int, pids: dict[int, int], world_size: int) -> None:
        """While attempt ``attempt`` runs (every monitor interval; ``pids``: {global rank: pid} of this
        node's ranks): once a hang record is there, mark the stopped ranks so that no rank waits for
        theirs, and SIGKILL them (:func:`~engine.launch.frozen.settle_hang`) before the ranks that wrote
        end theirs: torchrun would SIGTERM a stopped rank and wait 30 s for it."""
        self.silent.update(settle_hang(hang_folder(self.run_folder, attempt), pids, world_size))

    def attempt_started(self, attempt: int) -> None:
        """Before attempt ``attempt``'s ranks start: forget the reasons of the attempt before (its
        ranks are all stopped now) and record the start time for the goodput ledger."""
        for path in glob.glob(os.path.join(self.error_dir, "rank*.err")):
            os.remove(path)
        self.silent = {}
        _write_json(os.path.join(self.error_dir, f"attempt-{attempt}.start.json"),
                    {"attempt": attempt, "started_at": time.time()})

    def failed(self, attempt: int, failures: dict, world_size: int, restarts_left: int,
               pids: dict[int, int] | None = None) -> bool:
        """Attempt ``attempt`` failed (``failures``: {global rank: torchelastic ProcessFailure}; ``pids``:
        {global rank: pid} of this node's ranks); -> whether a restart may cure it. Writes
        ``restart-<attempt + 1>.json`` when one follows. A hang: its line, then this node's ranks that
        wrote no record are SIGKILLed."""
        failed_at = time.time()
        codes = {rank: failure.exitcode for rank, failure in failures.items()}
        messages = read_reasons(self.error_dir)
        self.hang = None
        if HANG_EXIT in codes.values() or self.silent:
            folder = hang_folder(self.run_folder, attempt)
            await_hang_records(folder, world_size)
            states = {rank: state for rank, pid in (pids or {}).items() if (state := proc_state(pid))}
            self.hang = hang_verdict(folder, world_size, self.hang_timeout_s, {**states, **self.silent})
            self.silent.update(kill_silent(folder, pids or {}))
            self.last_cause = "a " + self.hang.removeprefix("quadra: ")
        else:
            crashes = {rank: crash_summary(crash_report(self.stderr_files.get(rank)))
                       for rank, failure in failures.items() if failure.exitcode < 0}
            self.last_cause = failure_cause(codes, messages, {r: c for r, c in crashes.items() if c})
        curable = not incurable(messages) and not self.stop_requested()
        if curable and restarts_left > 0:
            _write_json(os.path.join(self.error_dir, f"restart-{attempt + 1}.json"),
                        {"attempt": attempt + 1, "cause": self.last_cause, "failed_at": failed_at,
                         "max_restarts": self.max_restarts})
        _write_json(os.path.join(self.error_dir, f"attempt-{attempt}.end.json"),
                    {"attempt": attempt, "cause": self.last_cause, "failed_at": failed_at})
        return curable


def _write_json(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class StderrTail:
    """Shows the ranks' stderr files on this process's stderr as they grow, lines unchanged (torchrun's
    own ``--tee`` would prefix each line with ``[default<local rank>]:``).

    Args:
        files: {local rank: its stderr file}; ranks without a file (not redirected) are skipped.
        shown: local ranks to show (``LOG_RANKS``); None: all.
    """

    def __init__(self, files: dict[int, str], shown: set[int] | None = None):
        files = {r: p for r, p in files.items() if p and p != os.devnull and (shown is None or r in shown)}
        self._tail = TailLog("rank", files, sys.stderr, {r: "" for r in files}).start() if files else None

    def stop(self) -> None:
        """Show what is left up to the end of each file (the ranks have ended), then stop."""
        if self._tail is not None:
            self._tail.stop()
            self._tail = None


class QuadraAgent(LocalElasticAgent):
    """torchrun's local agent that asks :class:`Recovery` before each restart and shows the ranks'
    redirected stderr (module docstring)."""

    recovery: Recovery  # set on the subclass :func:`run_elastic` makes
    _stderr_tail: StderrTail | None = None

    def _attempt(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _start_workers(self, worker_group):
        self.recovery.attempt_started(self._attempt())
        pids = super()._start_workers(worker_group)
        files = dict(getattr(self._pcontext, "stderrs", {}) or {})  # {local rank: path or ""}
        self.recovery.stderr_files = {w.global_rank: files[w.local_rank] for w in worker_group.workers
                                      if files.get(w.local_rank) not in (None, "", os.devnull)}
        self._stderr_tail = StderrTail(files, getattr(self._logs_specs, "_local_ranks_filter", None))
        return pids

    def _shutdown(self, *args, **kwargs) -> None:
        super()._shutdown(*args, **kwargs)  # the ranks are gone: their files end here
        if self._stderr_tail is not None:
            self._stderr_tail.stop()
            self._stderr_tail = None

    def _monitor_workers(self, worker_group):
        pids = {w.global_rank: w.id for w in worker_group.workers if isinstance(w.id, int)}
        self.recovery.watch(self._attempt(), pids, worker_group.workers[0].world_size if pids else 0)
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            world_size = worker_group.workers[0].world_size if worker_group.workers else 0
            if not self.recovery.failed(self._attempt(), result.failures, world_size, self._remaining_restarts,
                                        pids):
                self._remaining_restarts = 0  # torchrun's loop then stops the group and reports the failure
        return result


def run_elastic(torchrun_argv: list[str], recovery: Recovery) -> None:
    """``torch.distributed.run.run`` of ``torchrun_argv`` with :class:`QuadraAgent` as the agent.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: the job failed (after
            the restarts it was allowed).
    """
    from torch.distributed.run import get_args_parser, run

    agent = type("QuadraAgent", (QuadraAgent,), {"recovery": recovery})
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent  # the name launch_agent() builds its agent from
    try:
        run(get_args_parser().parse_args(torchrun_argv))
    finally:
        launcher_api.LocalElasticAgent = original
