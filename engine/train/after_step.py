"""The one line that ends a run when something after a trained step fails (engine/train/trainer.py:
the profiler's trace, metrics, validation or the checkpoint save): what failed, what is safe, the fix."""

from __future__ import annotations

import re

from engine.checkpoint import files as checkpoint_files

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
