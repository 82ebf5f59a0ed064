"""The seam around the training step (engine/train/services.py): the loop calls every service's hooks
at its fixed points, in the list's order, with the checkpoint save between ``on_step`` and
``after_save``; a failing report names its service's phase and keeps the saved step; and each service
works on what it was given, without a trainer (issue #49: services did reach back into the trainer)."""

from __future__ import annotations

import gc
import os
import types

import pytest

from engine.train.after_step import AfterStepError
from engine.train.evaluation import Evaluation
from engine.train.recovery import Layout, RunRecovery
from engine.train.services import CheckpointSaving, GarbageCollection, Service, StopSignals, save_then_report
from tests.checkpoint_utils import write_tiny_corpus
from tests.training_utils import base_args

HOOKS = ("on_start", "before_step", "on_step", "after_save", "on_end", "close")


class Recorder(Service):
    """Writes each hook call into ``events``; ``saved(step)`` says whether step's checkpoint is on disk."""

    def __init__(self, name: str, events: list, saved=lambda step: None):
        self.name, self.events, self.saved = name, events, saved

    def on_start(self, step, last):
        self.events.append((self.name, "on_start", step, last))

    def before_step(self, step):
        self.events.append((self.name, "before_step", step))

    def on_step(self, record):
        self.events.append((self.name, "on_step", record["step"], self.saved(record["step"])))

    def after_save(self, record):
        self.events.append((self.name, "after_save", record["step"], self.saved(record["step"])))

    def on_end(self, error):
        self.events.append((self.name, "on_end", error))

    def close(self, wait):
        self.events.append((self.name, "close", wait))


def test_the_loop_calls_every_hook_at_its_point_in_the_list_order(tmp_path):
    """3 steps, a checkpoint every 2 (and at the last): per step before_step, on_step (the step's
    checkpoint not yet on disk), after_save (on disk when due), first service before the last; then
    on_end and, from close, close(wait)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    argv = base_args(str(tmp_path / "run"), {"data.path": write_tiny_corpus(str(tmp_path)), "training.steps": 3,
                                             "checkpoint.enable": "true", "checkpoint.interval": 2,
                                             "validation.enable": "false"})
    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    events: list = []
    saved = lambda step: os.path.isdir(tmp_path / "run" / "checkpoint" / f"step-{step}")  # noqa: E731
    trainer.services = [Recorder("first", events, saved), *trainer.services, Recorder("last", events, saved)]
    try:
        history = trainer.train()
    finally:
        trainer.close()
    want = [("on_start", 0, 3)]
    for step, due in ((1, False), (2, True), (3, True)):
        want += [("before_step", step), ("on_step", step, False), ("after_save", step, due)]
    want += [("on_end", None), ("close", True)]
    assert [event[1:] for event in events if event[0] == "last"] == want
    assert [event for event in events if event[0] == "first"] == [("first", *event) for event in want]
    pairs = list(zip(events[::2], events[1::2]))  # each hook runs on "first", then on "last"
    assert all(a[0] == "first" and b[0] == "last" and a[1:] == b[1:] for a, b in pairs), events
    assert [record["step"] for record in history] == [1, 2, 3]


def test_a_stop_signal_is_agreed_before_the_first_step_and_after_each_report():
    calls = []
    request = types.SimpleNamespace(agreed=lambda: calls.append("agreed") or ("SIGTERM" if len(calls) == 2 else None),
                                    restore=lambda: calls.append("restore"))
    signals = StopSignals(request)
    signals.on_start(0, 5)
    assert signals.stopped_by is None
    signals.after_save({"step": 1})
    assert signals.stopped_by == "SIGTERM"
    signals.close(wait=False)
    assert calls == ["agreed", "agreed", "restore"]


class _Failing(Service):
    def __init__(self, phase: str, error: BaseException, events: list):
        self.phase, self.error, self.events = phase, error, events

    def after_save(self, record):
        self.events.append(self.phase)
        raise self.error


def _saving(events: list, fail: BaseException | None = None) -> CheckpointSaving:
    def maybe_save(step, final):
        events.append(("save", step, final))
        if fail is not None:
            raise fail

    checkpointer = types.SimpleNamespace(folder="unused", maybe_save=maybe_save, wait=lambda: events.append("wait"))
    return CheckpointSaving(checkpointer, enabled=False, last_step=9)


def test_the_save_comes_first_and_a_failing_report_names_its_phase():
    events: list = []
    services = [Recorder("metrics", events), _Failing("validation", PermissionError("disk full"), events),
                Recorder("after", events)]
    with pytest.raises(AfterStepError, match=r"^validation after step 4 failed \(PermissionError: disk full\); "
                                            r"no checkpoint holds it"):
        save_then_report(_saving(events), services, {"step": 4})
    assert events == [("save", 4, False), ("metrics", "after_save", 4, None), "validation"]  # "after" never ran

    events.clear()
    with pytest.raises(AfterStepError, match=r"^checkpoint save after step 9 failed \(OSError: no space\)"):
        save_then_report(_saving(events, OSError("no space")), services, {"step": 9})
    assert events == [("save", 9, True)]  # no report of an unsaved step

    lost_peer = RuntimeError("Connection reset by peer")  # engine/train/distributed.py is_peer_failure
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        save_then_report(_saving([]), [_Failing("metrics", lost_peer, [])], {"step": 1})


def test_services_work_on_what_they_are_given(tmp_path):
    """Each built from its own arguments, driven through its hooks, no trainer anywhere: evaluation
    (validation every 2 steps and at the last; its phase follows its work), gc, recovery (the watchdog
    starts after the first trained step and stops at the end) and the save timing."""
    logged, timed = [], []

    class Timing:
        def __init__(self, step):
            self.step = step

        def __enter__(self):
            timed.append(self.step)

        def __exit__(self, *exc):
            return False

    metrics = types.SimpleNamespace(log_validation=lambda step, loss, ppl: logged.append((step, loss)))
    evaluation = Evaluation(types.SimpleNamespace(enable=True, freq=2), lambda: 2.5, None, model_parts=[],
                            device="cpu", metrics=metrics, timing=Timing)
    evaluation.on_start(0, 5)
    for step in range(1, 6):
        evaluation.after_save({"step": step})
    assert logged == [(2, 2.5), (4, 2.5), (5, 2.5)] and timed == [2, 4, 5] and evaluation.phase == "metrics"

    collector = GarbageCollection(gc_freq=2)
    was_enabled = gc.isenabled()
    try:
        collector.on_start(0, 5)
        assert not gc.isenabled()
        collector.on_end(None)
        assert gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()

    dims = types.SimpleNamespace(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1)
    recovery = RunRecovery(60.0, str(tmp_path), rank=1, world_size=2, resumed_step=0, loaded_marker=None,
                           layout=Layout(dims, 8, 8, 1))
    recovery.on_start(0, 2)
    recovery.before_step(1)
    assert recovery.watchdog is None  # set-up and the first step may take longer than the timeout
    recovery.on_step({"step": 1, "step_seconds": 0.1})
    assert recovery.watchdog is not None
    recovery.on_end(None)
    assert recovery.watchdog is None

    events: list = []
    timed.clear()
    saving = _saving(events)
    saving.timing = Timing
    saving.save_due(3)
    assert events == [("save", 3, False)] and timed == [3]
