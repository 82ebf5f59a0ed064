"""The seam around the training step: services with a small fixed set of hooks.

``Trainer.train`` (engine/train/trainer.py) keeps the step itself explicit (``train_step``: the math,
torchft's commit order) and the checkpoint save point; everything else that happens around a step
is a :class:`Service`, built once with the objects and config sections it needs (never the trainer),
and called at fixed points of the loop, in the order of the trainer's list:

- ``on_start(step, last)``: ``train()`` begins after ``step`` completed steps and trains up to ``last``;
- ``before_step(step)``: step ``step`` (1-based) begins, before its first collective;
- ``on_step(record)``: the step is committed and counted, *before* its checkpoint save: quick work that
  must not wait for the save (the watchdog's beat, stopping a trace);
- ``after_save(record)``: the step's due checkpoint is complete (or none was due): reports. A failure
  here ends the run with one line naming the service's :attr:`Service.phase`
  (engine/train/after_step.py); the saved step is never lost (:func:`save_then_report`);
- ``on_end(error)``: ``train()`` returns (``error`` None) or raises ``error``;
- ``close(wait)``: the trainer closes; ``wait`` False after a failure (do not wait on other ranks).

The step's record (``Trainer.train_step``) holds ``step``, ``loss``, ``z_loss``, ``grad_norm``, ``lr``,
``tokens``, ``global_tokens``, ``data_seconds``, ``step_seconds``, ``epoch``, ``model_metrics``,
``skipped``, ``committed`` and, where they apply, ``replicas``, ``pp_bubble_fraction`` and ``phases``
(which the metrics service takes out of it on a logged step).

The shape is that of OLMo-core's trainer callbacks (https://github.com/allenai/OLMo-core,
``src/olmo_core/train/callbacks/callback.py``: ``pre_train``, ``pre_step``, ``post_step``,
``post_checkpoint_saved``, ``post_train`` and ``on_error``, here one ``on_end``, ``close``), without their
back-reference to the trainer: a service cannot read what it was not given.

This module holds the base class and the small services (profiling, metrics, gc, stop signals,
checkpoint saving); recovery (engine/train/recovery.py) and evaluation (engine/train/evaluation.py)
live beside their logic.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from engine.train.after_step import AfterStepError, after_step_message, log_step
from engine.train.distributed import is_peer_failure


class Service:
    """A concern around the training step; every hook is a no-op unless overridden (module docstring).

    Attributes:
        phase: what the service is doing, named in the one-line error when its ``after_save`` raises
            (engine/train/after_step.py ``after_step_message``: "profiler", "metrics", "validation",
            "downstream evaluation", "checkpoint save" or "reporting"); a service may change it
            while it works.
    """

    phase = "reporting"

    def on_start(self, step: int, last: int) -> None:
        """``train()`` begins after ``step`` completed steps; it stops after step ``last`` at the latest."""

    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based) begins."""

    def on_step(self, record: dict) -> None:
        """Step ``record["step"]`` is trained and counted; its checkpoint save comes next."""

    def after_save(self, record: dict) -> None:
        """Step ``record["step"]`` is saved when a save was due: report it."""

    def on_end(self, error: BaseException | None) -> None:
        """``train()`` ends, normally (``error`` None) or by ``error``."""

    def close(self, wait: bool) -> None:
        """The trainer closes (``wait`` False after a failure: nothing may wait on other ranks)."""


def call(services: list[Service], hook: str, *args) -> None:
    """Call ``hook`` on every service, in the list's order."""
    for service in services:
        getattr(service, hook)(*args)


def save_then_report(saving: CheckpointSaving, services: list[Service], record: dict) -> None:
    """The loop's save point and the reports after it: save step ``record["step"]`` when due
    (``saving.save_due``), then call ``after_save`` on every service. A failure in either (a full
    disk, a failed validation) ends the run with one line naming the failing service's phase and the
    newest complete checkpoint, which still holds every saved step.

    Raises:
        AfterStepError: the save or a report failed (the original error is its ``__cause__``).
        The original error when it is another rank's failure (engine/train/distributed.py ``is_peer_failure``).
    """
    step, current = record["step"], saving
    try:
        saving.save_due(step)
        for current in services:
            current.after_save(record)
    except Exception as error:
        if is_peer_failure(error):
            raise
        raise AfterStepError(after_step_message(error, current.phase, step, saving.folder)) from error


class Profiling(Service):
    """``[profiling]``: the torch profiler's traced steps and the CUDA memory snapshots.

    Args:
        profiler: the run's ``engine.observe.profiling.StepProfiler``.
    """

    phase = "profiler"

    def __init__(self, profiler):
        self.profiler = profiler
        self.step = 0

    def before_step(self, step: int) -> None:
        self.step = step
        self.profiler.step_begin(step)

    def on_step(self, record: dict) -> None:
        self.profiler.step_end(record["step"])  # before the save: the save stays out of the trace

    def after_save(self, record: dict) -> None:
        self.profiler.write(record["step"])  # a file write can fail: after the save

    def on_end(self, error: BaseException | None) -> None:
        if isinstance(error, torch.OutOfMemoryError):  # the step that ran out of memory
            self.profiler.dump_memory_snapshot(self.step)

    def close(self, wait: bool) -> None:
        self.profiler.close()


class Metrics(Service):
    """Each step's tokens and seconds, and on logged steps its line and records
    (engine/train/after_step.py ``log_step``).

    Args:
        metrics: the run's ``engine.observe.metrics.MetricsLogger`` (closed by :meth:`close`).
        dataloader: its ``log_metrics()`` (tokens per data source) go to the files on logged steps.
    """

    phase = "metrics"

    def __init__(self, metrics, dataloader):
        self.metrics, self.dataloader = metrics, dataloader

    def after_save(self, record: dict) -> None:
        log_step(self.metrics, record["step"], record, self.dataloader)

    def close(self, wait: bool) -> None:
        self.metrics.close()


class GarbageCollection(Service):
    """``training.gc_freq`` = N > 0: Python's automatic collection is off while training, and every
    N steps a generation-1 collection runs on every rank at the same step, so that ranks do not stall
    each other at random times; 0 leaves the collector alone."""

    def __init__(self, gc_freq: int):
        self.gc_freq = gc_freq

    def on_start(self, step: int, last: int) -> None:
        if self.gc_freq > 0:
            gc.disable()

    def after_save(self, record: dict) -> None:
        if self.gc_freq > 0 and record["step"] % self.gc_freq == 0:
            gc.collect(1)

    def on_end(self, error: BaseException | None) -> None:
        if self.gc_freq > 0:
            gc.enable()


class StopSignals(Service):
    """SIGTERM / SIGUSR1 / SIGINT (engine/train/signals.py): every rank agrees, once before the first
    step and after each reported step, whether any rank received one.

    Args:
        stop_request: the run's ``engine.train.signals.StopRequest`` (its handlers are restored by
            :meth:`close`, last of all: a SIGTERM while the metrics close cannot cut W&B's records).

    Attributes:
        stopped_by: the agreed signal's name, or None; the trainer stops its loop on it.
    """

    def __init__(self, stop_request):
        self.stop_request = stop_request
        self.stopped_by: str | None = None

    def on_start(self, step: int, last: int) -> None:
        self.stopped_by = self.stop_request.agreed()  # a signal during set-up: no step is trained

    def after_save(self, record: dict) -> None:
        self.stopped_by = self.stop_request.agreed()

    def close(self, wait: bool) -> None:
        self.stop_request.restore()


class CheckpointSaving(Service):
    """When the checkpoints of the loop are saved: every ``checkpoint.interval`` steps and at the last
    step (complete on disk before anything reports it), and when a stop signal ends the run. The
    trainer calls :meth:`save_due` at the loop's save point, between ``on_step`` and ``after_save``.

    Args:
        checkpointer: the run's ``engine.checkpoint.CheckpointManager`` (closed by :meth:`close`).
        enabled: ``checkpoint.enable``.
        last_step: ``training.steps`` (the final save waits until complete).
        timing: ``timing(step)``, a context manager around each save (the goodput ledger's checkpoint
            time and the watchdog's beat, engine/train/recovery.py), or None.
    """

    phase = "checkpoint save"

    def __init__(self, checkpointer, *, enabled: bool, last_step: int, timing=None):
        self.checkpointer, self.enabled, self.last_step = checkpointer, enabled, last_step
        self.timing = timing or (lambda step: contextlib.nullcontext())
        self.folder = checkpointer.folder if enabled else None  # where a failure's message looks

    def save_due(self, step: int) -> None:
        """After step ``step``: save when due; the final step's save is complete when this returns."""
        final = step == self.last_step
        with self.timing(step):
            self.checkpointer.maybe_save(step, final=final)
            if final:
                self.checkpointer.wait()  # the last step is complete on disk before validation

    def save_now(self, step: int) -> bool:
        """A stop signal after step ``step``: every rank saves it together and waits; -> whether it saved."""
        if not self.enabled:
            return False
        with self.timing(step):
            self.checkpointer.save(step, wait=True)
        return True

    def close(self, wait: bool) -> None:
        if wait:  # finishing a save in flight may need the other ranks
            self.checkpointer.close()
