"""After a trained step (engine/train/trainer.py): its metrics record and log line, and the one line
that ends a run when something after the step fails (the profiler's trace, metrics, validation or
the checkpoint save): what failed, what is safe, the fix."""

from __future__ import annotations

import re

from engine.checkpoint import files as checkpoint_files
from engine.observe.attribution import step_attribution

# What the step's log line shows of its record, in this order, where present (engine/observe/metrics.py).
LOGGED_KEYS = ("loss", "z_loss", "grad_norm", "lr", "epoch", "pp_bubble_fraction", "replicas")


def log_step(metrics, step: int, record: dict, dataloader) -> None:
    """Hand a trained step to ``metrics`` (a MetricsLogger): its tokens and seconds every step; on a
    logged step (``metrics.log_freq``) also its line and records, i.e. :data:`LOGGED_KEYS` and the
    model's metrics, plus, in the files only, the step time's attribution (seconds per part,
    engine/observe/attribution.py) and ``dataloader.log_metrics()`` (tokens per data source).

    Args:
        record: the trainer's step record (``tokens``, ``step_seconds``, ``data_seconds``,
            ``model_metrics``, optional ``phases``, which is removed, and the keys above).
    """
    metrics.record_step(tokens=record["tokens"], step_seconds=record["step_seconds"],
                        data_seconds=record["data_seconds"])
    if metrics.should_log(step):
        logged = {key: record[key] for key in LOGGED_KEYS if record.get(key) is not None}
        phases = record.pop("phases", None)
        times = step_attribution(step_s=record["step_seconds"], **phases) if phases else {}
        metrics.log(step, {**logged, **record["model_metrics"]}, files_only={**times, **dataloader.log_metrics()})


class AfterStepError(RuntimeError):
    """Reporting after a trained and saved step failed (profiler trace, metrics, validation); the
    message (:func:`after_step_message`) is one line naming the phase, the step, the reason and the
    newest complete checkpoint."""


_FIXES = {"validation": "set validation.enable = false to train on without it",
          "downstream evaluation": "set eval.enable = false to train on without it",
          "profiler": "set profiling.enable = false",
          "metrics": "check the run folder's disk space and permissions",
          "checkpoint save": "check the checkpoint folder's disk space and permissions"}


def after_step_message(error: BaseException, phase: str, step: int, checkpoint_folder: str | None) -> str:
    """One line for a failure in ``phase`` after step ``step`` was trained.

    Args:
        error: what was raised.
        phase: "profiler", "metrics", "validation", "checkpoint save" or "reporting".
        step: the step that was trained (and, when due, saved) before the failure.
        checkpoint_folder: the run's checkpoint folder, or None with ``checkpoint.enable = false``.
    """
    lines = str(error).strip().splitlines()
    # DCP's CheckpointException opens with "ranks:..." and quotes each rank's traceback: name the
    # innermost error instead (e.g. "PermissionError: [Errno 13] ... step-2.tmp").
    causes = [line.strip() for line in lines if re.match(r"\s*\w+(Error|Exception): ", line)]
    reason = (causes[-1] if causes and len(lines) > 1 else (lines or [""])[0])[:300] or "(no message)"
    saved = checkpoint_files.scan(checkpoint_folder).latest if checkpoint_folder is not None else None
    if saved is None:
        kept = "no checkpoint holds it (checkpoint.enable = false)" if checkpoint_folder is None \
            else "no checkpoint was complete yet"
    else:
        kept = f"checkpoint step-{saved} is complete; the same command resumes from it"
    fix = _FIXES.get(phase, "")
    return (f"{phase} after step {step} failed ({type(error).__name__}: {reason}); {kept}"
            f"{'; ' + fix if fix else ''}; QUADRA_TRACEBACK=1 shows the traceback")
