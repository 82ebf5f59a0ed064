"""The rank side of a run that keeps itself alive: one object the trainer calls at a few points.

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

from engine.observe.goodput import AttemptLedger, ledger, read_attempts, read_json_record, summary_text
from engine.observe.hang import HangWatchdog, attempt_number, test_hook

logger = logging.getLogger("quadra")


class RunRecovery:
    """Built by the trainer after its checkpoint load (module docstring).

    Args:
        cfg: the job config (reads ``comm.hang_timeout_seconds``, ``checkpoint.enable``,
            ``training.local_batch_size``).
        trainer: the trainer (``step`` after the load, ``dist``, ``run_folder``, ``parallel_dims``,
            ``global_batch_size``, ``grad_accum_steps``, ``checkpointer.loaded_marker``).
    """

    def __init__(self, cfg, trainer):
        self.cfg, self.trainer = cfg, trainer
        self.rank = trainer.dist.rank
        self.attempt = attempt_number()
        self.state_dir = os.environ.get("QUADRA_ERROR_DIR") or None
        self.launch_time = float(os.environ.get("QUADRA_LAUNCH_TIME") or time.time())
        self.watchdog: HangWatchdog | None = None
        self._training = False
        self.ledger = (AttemptLedger(self.state_dir, self.attempt, self.launch_time, trainer.step)
                       if self.rank == 0 else None)
        if self.rank == 0:
            self._say_why()

    def _say_why(self) -> None:
        """The restart line and the layout line (rank 0)."""
        restart = (read_json_record(os.path.join(self.state_dir, f"restart-{self.attempt}.json"))
                   if self.state_dir else None)
        step = self.trainer.step
        if restart is not None:
            resumed = f"resumed from checkpoint step-{step}" if step else "started again from step 0 (no checkpoint)"
            again = self.ledger.retrained_range()
            if getattr(self.trainer, "ft", None) is not None:  # torchft: it heals from a live group instead
                resumed, again = "rejoins the replica groups and heals from a live one at its first step", None
            again = "" if not again else (f"; step {again[0]} is trained again" if again[0] == again[1]
                                          else f"; steps {again[0]}-{again[1]} are trained again")
            logger.warning("quadra: restart %d of %s after %s: %s%s", self.attempt, restart.get("max_restarts", "?"),
                           restart["cause"], resumed, again)
        marker = getattr(self.trainer.checkpointer, "loaded_marker", None) or {}
        line = layout_change(marker, self.trainer)
        if line:
            logger.warning("quadra: %s", line)

    def start(self) -> None:
        """Training begins; the hang watchdog starts at the end of the first step (set-up, and the
        first step's warm-up and compilation, may take longer than its timeout)."""
        self._training = True

    def step_started(self, step: int) -> None:
        """Step ``step`` begins (before its first collective)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.ledger is not None:
            self.ledger.step_started()
        ft = getattr(self.trainer, "ft", None)  # QUADRA_TEST_FAULT only: the tests' hang, killed rank or node
        test_hook(step, self.rank, wait_for_every_group=ft.wait_for_every_group if ft is not None else None)

    def step_done(self, step: int, seconds: float) -> None:
        """Step ``step`` is done after ``seconds`` (wall seconds of the step itself)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        elif self._training:
            self.watchdog = HangWatchdog(self.cfg.comm.hang_timeout_seconds, self.trainer.run_folder, self.rank,
                                         world_size=self.trainer.dist.world_size)
        if self.ledger is not None:
            self.ledger.step_done(step, seconds)

    @contextlib.contextmanager
    def checkpointing(self):
        """Around a checkpoint save in the loop: its time is a checkpoint stall in the ledger, and
        the watchdog counts it as progress when done."""
        start = time.perf_counter()
        yield
        if self.watchdog is not None:
            self.watchdog.beat(self.trainer.step)
        if self.ledger is not None:
            self.ledger.checkpoint(time.perf_counter() - start)

    @contextlib.contextmanager
    def evaluating(self):
        """Around an evaluation between steps (validation, ``[eval]`` tasks): its time is evaluation
        time in the ledger, and the watchdog counts it as progress when done."""
        start = time.perf_counter()
        yield
        if self.watchdog is not None:
            self.watchdog.beat(self.trainer.step)
        if self.ledger is not None:
            self.ledger.evaluation(time.perf_counter() - start)

    def stop(self) -> None:
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


def layout_change(marker: dict, trainer) -> str | None:
    """The line saying the run continues under another world size than its checkpoint's, with the
    degrees and the gradient accumulation that keep the global batch; None when the same."""
    saved_world = marker.get("world_size")
    world = trainer.dist.world_size
    if not saved_world or saved_world == world:
        return None
    dims = trainer.parallel_dims
    before = marker.get("degrees", {})
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    changed = [f"{name} {getattr(dims, name)} (was {before[name]})" for name in names
               if name in before and before[name] != getattr(dims, name)]
    dp_before = before.get("dp_replicate", 1) * before.get("dp_shard", 1)
    local = trainer.cfg.training.local_batch_size
    accum_before = max(trainer.global_batch_size // max(local * dp_before, 1), 1)
    return (f"the group continues on world_size {world} (was {saved_world}): {', '.join(changed) or 'same degrees'}; "
            f"global batch {trainer.global_batch_size} sequences kept with {trainer.grad_accum_steps} "
            f"microbatch{'es' * (trainer.grad_accum_steps != 1)} per step (was {accum_before})")
