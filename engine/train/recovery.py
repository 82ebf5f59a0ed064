"""The rank side of a run that keeps itself alive: one service of the loop (engine/train/services.py).

- After the checkpoint load, rank 0 says in one line why this attempt runs (a restart: which rank
  failed and how, from ``restart-K.json`` of the launcher's agent, engine/launch/elastic.py) and from
  which step it resumed, and, when the world size differs from the checkpoint's (the group shrank or
  grew: ``NNODES=MIN:MAX``), the new layout.
- The hang watchdog (engine/observe/hang.py) is beaten at every step.
- Rank 0 keeps the goodput ledger of its attempt (engine/observe/goodput.py) and, at the end of the
  launch, writes the ledger to metrics.jsonl and TensorBoard and gives the goodput for the final line.

Environment (set by engine/launch/launcher.py): ``QUADRA_ERROR_DIR`` (the launch's state folder),
``QUADRA_LAUNCH_TIME`` (Unix seconds), ``QUADRA_MAX_RESTARTS``; torchrun's ``TORCHELASTIC_RESTART_COUNT``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from engine.observe.goodput import AttemptLedger, ledger, read_attempts, read_json_record, summary_text
from engine.observe.hang import HangWatchdog, attempt_number, test_hook
from engine.train.services import Service

logger = logging.getLogger("quadra")


class RunRecovery(Service):
    """Built by the trainer after its checkpoint load (module docstring); a service of the loop
    (engine/train/services.py: ``on_start``, ``before_step``, ``on_step``, ``on_end``), whose
    :meth:`checkpointing` and :meth:`evaluating` time the saves and evaluations between steps.

    Args:
        hang_timeout_seconds: ``comm.hang_timeout_seconds`` (the watchdog's limit).
        run_folder: the run folder (the watchdog's reports).
        rank, world_size: this rank and the world size.
        resumed_step: the step the checkpoint load resumed at (0: a fresh start).
        loaded_marker: the loaded checkpoint's ``quadra.json`` (``CheckpointManager.loaded_marker``), or None.
        layout: :class:`Layout`, this run's degrees and batch geometry (the layout line).
        replica_group: torchft's ``engine.train.fault_tolerance.ReplicaGroup``, or None.
    """

    def __init__(self, hang_timeout_seconds: float, run_folder: str, *, rank: int, world_size: int,
                 resumed_step: int, loaded_marker: dict | None, layout: Layout, replica_group=None):
        self.hang_timeout_seconds, self.run_folder = hang_timeout_seconds, run_folder
        self.rank, self.world_size, self.replica_group = rank, world_size, replica_group
        self.attempt = attempt_number()
        self.state_dir = os.environ.get("QUADRA_ERROR_DIR") or None
        self.launch_time = float(os.environ.get("QUADRA_LAUNCH_TIME") or time.time())
        self.watchdog: HangWatchdog | None = None
        self._training = False
        self.ledger = (AttemptLedger(self.state_dir, self.attempt, self.launch_time, resumed_step)
                       if self.rank == 0 else None)
        if self.rank == 0:
            self._say_why(resumed_step, loaded_marker or {}, layout)

    def _say_why(self, step: int, marker: dict, layout: Layout) -> None:
        """The restart line and the layout line (rank 0)."""
        restart = (read_json_record(os.path.join(self.state_dir, f"restart-{self.attempt}.json"))
                   if self.state_dir else None)
        if restart is not None:
            resumed = f"resumed from checkpoint step-{step}" if step else "started again from step 0 (no checkpoint)"
            again = self.ledger.retrained_range()
            if self.replica_group is not None:  # torchft: it heals from a live group instead
                resumed, again = "rejoins the replica groups and heals from a live one at its first step", None
            again = "" if not again else (f"; step {again[0]} is trained again" if again[0] == again[1]
                                          else f"; steps {again[0]}-{again[1]} are trained again")
            logger.warning("quadra: restart %d of %s after %s: %s%s", self.attempt, restart.get("max_restarts", "?"),
                           restart["cause"], resumed, again)
        line = layout_change(marker, layout, self.world_size)
        if line:
            logger.warning("quadra: %s", line)

    def on_start(self, step: int, last: int) -> None:
        """Training begins; the hang watchdog starts at the end of the first step (set-up, and the
        first step's warm-up and compilation, may take longer than its timeout)."""
        self._training = True

    def before_step(self, step: int) -> None:
        """Step ``step`` begins (before its first collective)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.ledger is not None:
            self.ledger.step_started()
        group = self.replica_group  # QUADRA_TEST_FAULT only: the tests' hang, killed rank or node
        test_hook(step, self.rank, wait_for_every_group=group.wait_for_every_group if group is not None else None)

    def on_step(self, record: dict) -> None:
        """Step ``record["step"]`` is done after ``record["step_seconds"]`` (wall seconds of the step itself)."""
        step = record["step"]
        if self.watchdog is not None:
            self.watchdog.beat(step)
        elif self._training:
            self.watchdog = HangWatchdog(self.hang_timeout_seconds, self.run_folder, self.rank,
                                         world_size=self.world_size)
        if self.ledger is not None:
            self.ledger.step_done(step, record["step_seconds"])

    @contextlib.contextmanager
    def checkpointing(self, step: int):
        """Around a checkpoint save after step ``step``: its time is a checkpoint stall in the ledger,
        and the watchdog counts it as progress when done."""
        start = time.perf_counter()
        yield
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.ledger is not None:
            self.ledger.checkpoint(time.perf_counter() - start)

    @contextlib.contextmanager
    def evaluating(self, step: int):
        """Around an evaluation after step ``step`` (validation, ``[eval]`` tasks): its time is
        evaluation time in the ledger, and the watchdog counts it as progress when done."""
        start = time.perf_counter()
        yield
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.ledger is not None:
            self.ledger.evaluation(time.perf_counter() - start)

    def on_end(self, error: BaseException | None) -> None:
        """Training ended (or failed): the watchdog stops."""
        self._training = False
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def finish(self, metrics, end: str) -> str | None:
        """Rank 0 at the end of the launch: the ledger into metrics.jsonl / TensorBoard; -> the
        goodput phrase of the final line (None on other ranks)."""
        if self.ledger is None or self.ledger.record["last_step"] == self.ledger.record["resumed_from"]:
            return None  # no step trained: nothing to account (and no record to replace)
        self.ledger.save()
        earlier = [a for a in read_attempts(self.state_dir) if a["attempt"] < self.attempt]
        attempts = [*earlier, self.ledger.record]
        records, summary = ledger(self.state_dir, attempts, self.launch_time, time.time(), end=end)
        # The summary first: the first record a launch writes decides from which step metrics.jsonl
        # replaces an earlier launch's records (engine/observe/metrics.py); the attempts' steps are older.
        metrics.log_event("goodput", summary)
        for record in records:
            metrics.log_event("attempt", record)
        return summary_text(summary)


@dataclass(frozen=True)
class Layout:
    """What the layout line compares with a checkpoint's marker: the degrees (``ParallelDims``: its
    ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``) and the batch geometry, in sequences."""

    parallel_dims: Any
    local_batch_size: int
    global_batch_size: int
    grad_accum_steps: int


def layout_change(marker: dict, layout: Layout, world: int) -> str | None:
    """The line saying the run continues on world size ``world``, not its checkpoint's (``marker``),
    with the degrees and the gradient accumulation that keep the global batch; None when the same."""
    saved_world = marker.get("world_size")
    if not saved_world or saved_world == world:
        return None
    dims = layout.parallel_dims
    before = marker.get("degrees", {})
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    changed = [f"{name} {getattr(dims, name)} (was {before[name]})" for name in names
               if name in before and before[name] != getattr(dims, name)]
    dp_before = before.get("dp_replicate", 1) * before.get("dp_shard", 1)
    accum_before = max(layout.global_batch_size // max(layout.local_batch_size * dp_before, 1), 1)
    accum = layout.grad_accum_steps
    return (f"the group continues on world_size {world} (was {saved_world}): {', '.join(changed) or 'same degrees'}; "
            f"global batch {layout.global_batch_size} sequences kept with {accum} "
            f"microbatch{'es' * (accum != 1)} per step (was {accum_before})")
