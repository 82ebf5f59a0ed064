"""Step capsules: ``<run folder>/capsules/step-K.json``, what is needed to re-run a skipped or fatal step.

A capsule names the step's data by its global window positions (engine/data/loader.py: step K reads
the positions [p, p + global_batch_size) of the global sequence, whatever the layout), the newest
complete checkpoint before K that the step can be replayed from (load it, train K - N steps: the last
one is step K), the spike statistics the decision used, the judged values and the config fingerprint
(engine/config/fingerprint.py), so that the step can be re-run under another parallel layout or in
another precision and compared. Written by rank 0 (every rank takes the same decision).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from engine.checkpoint import files as checkpoint_files

logger = logging.getLogger("quadra")

CAPSULE_FOLDER = "capsules"
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def _json_number(value: Any) -> Any:
    """Strict JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_number(v) for v in value]
    return value


def replay_source(checkpoint_folder: str | None, step: int) -> dict:
    """The newest complete checkpoint before ``step`` in ``checkpoint_folder`` (None: checkpointing is
    off): ``{"checkpoint": path or None, "step": N, "steps_to_replay": step - N}``. Without one, the
    run's own start (step 0: the seeded initialization of the same config) is the replay source."""
    complete = checkpoint_files.scan(checkpoint_folder).complete if checkpoint_folder else {}
    before = [saved for saved in complete if saved < step]
    if not before:
        return {"checkpoint": None, "step": 0, "steps_to_replay": step}
    newest = max(before)
    return {"checkpoint": os.path.abspath(complete[newest]), "step": newest, "steps_to_replay": step - newest}


def capsule_path(run_folder: str, step: int) -> str:
    """``<run_folder>/capsules/step-<step>.json``."""
    return os.path.join(run_folder, CAPSULE_FOLDER, f"step-{step}.json")


def write_capsule(path: str, verdict, *, loader_state: dict, lr: float, fingerprint: str,
                  checkpoint_folder: str | None, world_size: int, parallel_dims, thresholds: dict) -> None:
    """Write the capsule of ``verdict.step`` to ``path`` (:func:`capsule_path`) atomically.

    Args:
        path: the capsule file; the run's config.toml is expected two folders up.
        verdict: the step's ``engine.train.step_health.Verdict``.
        loader_state: the data loader's ``state_dict()`` *after* the step (position p + G).
        lr: the learning rate the step would have applied.
        fingerprint: the run's config fingerprint.
        checkpoint_folder: the checkpoint folder, or None when checkpointing is off.
        world_size, parallel_dims: the layout of the run that wrote it (its degrees are recorded).
        thresholds: the ``[step_health]`` settings.
    """
    global_batch = int(loader_state["global_batch_size"])
    before = {k: v for k, v in loader_state.items() if k != "stream"}  # the stream note is of the later position
    before["position"] = int(loader_state["position"]) - global_batch  # a step reads whole global batches
    capsule = {
        "step": verdict.step,
        "action": "stopped" if verdict.fatal else "skipped",
        "reason": verdict.reason,
        "value": verdict.value,
        "zscore": verdict.zscore,
        "loss": verdict.loss,
        "grad_norm": verdict.grad_norm,
        "lr": lr,
        "message": verdict.fatal,
        "statistics": verdict.statistics,
        "thresholds": thresholds,
        "data": {"first_position": before["position"], "global_batch_size": global_batch,
                 "positions": [before["position"], before["position"] + global_batch],
                 "loader_state_before": before},
        "replay_from": replay_source(checkpoint_folder, verdict.step),
        "fingerprint": fingerprint,
        "config": os.path.abspath(os.path.join(os.path.dirname(path), os.pardir, "config.toml")),
        "layout": {"world_size": world_size, **{k: getattr(parallel_dims, k) for k in DEGREES}},
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        json.dump(_json_number(capsule), file, indent=1, sort_keys=True)
        file.write("\n")
    os.replace(path + ".tmp", path)


class UnhealthyStepReport:
    """Reports a skipped or fatal step (``Trainer.train_step`` calls it with the step's verdict): on
    rank 0 the capsule, the ``skipped_step`` metrics record and, for a skip, the console line (a
    failure to write them is a warning, so the ranks stay in step).

    Args:
        run_folder: the capsules go to ``<run_folder>/capsules/``.
        rank, world_size, parallel_dims: this rank and the layout recorded in each capsule.
        dataloader: its ``state_dict()`` after the step names the step's data.
        fingerprint: the run's config fingerprint.
        thresholds: the ``[step_health]`` settings, as a dict.
        checkpoint_folder: the checkpoint folder (the replay source), or None when checkpointing is off.
        metrics: the run's ``engine.observe.metrics.MetricsLogger``.
        step_health: the run's ``engine.train.step_health.StepHealth`` (its skip count).
    """

    def __init__(self, run_folder: str, *, rank: int, world_size: int, parallel_dims, dataloader, fingerprint: str,
                 thresholds: dict, checkpoint_folder: str | None, metrics, step_health):
        self.run_folder, self.rank, self.world_size, self.parallel_dims = run_folder, rank, world_size, parallel_dims
        self.dataloader, self.fingerprint, self.thresholds = dataloader, fingerprint, thresholds
        self.checkpoint_folder, self.metrics, self.step_health = checkpoint_folder, metrics, step_health

    def __call__(self, verdict, lr: float) -> str:
        """Report ``verdict`` (``lr``: the rate the step would have applied); -> the capsule's path
        (the caller raises for a fatal verdict)."""
        path = capsule_path(self.run_folder, verdict.step)
        if self.rank != 0:
            return path
        try:
            write_capsule(path, verdict, loader_state=self.dataloader.state_dict(), lr=lr,
                          fingerprint=self.fingerprint, world_size=self.world_size, parallel_dims=self.parallel_dims,
                          thresholds=self.thresholds, checkpoint_folder=self.checkpoint_folder)
            self.metrics.log_event("skipped_step", {"step": verdict.step, "reason": verdict.reason,
                                                    "value": verdict.value, "zscore": verdict.zscore,
                                                    "skipped_total": self.step_health.skipped})
        except OSError as error:
            logger.warning("step %d: capsule or metrics record not written (%s)", verdict.step, error)
        if verdict.fatal is None:
            z = "n/a" if verdict.zscore is None else f"{verdict.zscore:.2f}"
            logger.warning("step %d skipped: %s %s (z-score %s); capsule %s", verdict.step, verdict.reason,
                           verdict.value, z, path)
        return path
