"""Which checkpoint a run loads, and where it falls back to when one is damaged; decided on rank 0.

Order (engine/checkpoint/manager.py loads, verifies and agrees across ranks):

1. ``checkpoint.load_step = N``: step-N only; damaged, the run refuses, naming it.
2. Else the ``step-N`` folders of the checkpoint folder, newest first: the first that verifies
   (engine/checkpoint/manifest.py) and reads is loaded. Each damaged one is named in a warning line
   with the file and the reason; a fall-back is said in one line; when every one is damaged the run
   refuses: it never starts again from step 0 while checkpoints exist.
3. Else ``checkpoint.initial_load_path`` (damaged: the run refuses).
4. Else a fresh start at step 0.

Torch-free; the lines that report damage are built here so their wording lives in one place.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine.checkpoint import files
from engine.checkpoint.files import CheckpointError

logger = logging.getLogger("quadra")


@dataclass
class Candidate:
    """A checkpoint folder to try: its step, whether it holds model weights only, its quadra.json
    (None when unreadable), and ``problem``: damage found while listing (no marker, no metadata)."""

    path: str
    step: int
    model_only: bool
    marker: dict | None
    problem: str | None = None
    initial: bool = False  # checkpoint.initial_load_path (another run's), not this run's own folder


@dataclass
class LoadPlan:
    """Candidates, newest first. ``setting`` names the setting that chose the only candidate (e.g.
    ``checkpoint.load_step = 4: checkpoint '.../step-4'``): then damage refuses instead of falling
    back, with ``fix``."""

    candidates: list[Candidate]
    setting: str | None = None
    fix: str = ""


def plan_load(cfg, folder: str) -> LoadPlan | None:
    """What to load for the ``[checkpoint]`` section ``cfg`` from ``folder``; None: a fresh start.

    Removes ``step-N.tmp`` folders (saves that did not finish) with a warning.

    Raises:
        CheckpointError: ``load_step`` names no checkpoint folder, or ``initial_load_path`` is not a
            DCP checkpoint folder.
    """
    found = files.scan(folder)
    files.remove_partial(found)
    steps = {**found.incomplete, **found.complete}
    if cfg.load_step >= 0:
        if cfg.load_step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step = {cfg.load_step}: there is no complete checkpoint step-"
                f"{cfg.load_step} in {folder!r} (complete: {sorted(found.complete) or 'none'}). "
                "Fix: pick one of those steps, or set checkpoint.load_step = -1 for the newest")
        newer = [step for step in found.complete if step > cfg.load_step]
        if newer:
            logger.warning("checkpoint.load_step = %d: the newer checkpoints %s stay until this run "
                           "saves over them (a restart without load_step resumes from the newest)",
                           cfg.load_step, sorted(newer))
        path = steps[cfg.load_step]
        return LoadPlan([_candidate(cfg.load_step, path)],
                        f"checkpoint.load_step = {cfg.load_step}: checkpoint {path!r}",
                        "choose another step, or checkpoint.load_step = -1 to resume from the newest "
                        "checkpoint that verifies")
    if steps:
        return LoadPlan([_candidate(step, steps[step]) for step in sorted(steps, reverse=True)])
    if cfg.initial_load_path:
        path = cfg.initial_load_path
        problem = initial_load_problem(path)
        if problem:
            raise CheckpointError(problem)
        # A folder without quadra.json (written elsewhere) is not damaged: it has no manifest.
        # A full load of a weights-only folder fails in the manager with a clear message.
        marker = files.read_marker(path) or {"step": 0}
        candidate = Candidate(path, int(marker.get("step", 0)), cfg.initial_load_model_only, marker, initial=True)
        return LoadPlan([candidate], f"checkpoint.initial_load_path = {path!r}", "point it at another checkpoint")
    logger.info("no checkpoint in %s: starting from step 0", folder)
    return None


def initial_load_problem(path: str) -> str | None:
    """Why ``checkpoint.initial_load_path`` cannot be loaded as one DCP checkpoint, in one line with
    the fix (a path that does not exist, a run's checkpoint folder instead of one of its step-N
    folders, a folder without DCP's metadata), or None. Torch-free: the launcher's pre-flight asks."""
    where = f"checkpoint.initial_load_path = {path!r}"
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        steps = sorted(files.scan(parent).complete) if os.path.isdir(parent) else []
        found = f"; {parent} holds {', '.join(f'step-{n}' for n in steps)}" if steps else ""
        return f"{where} does not exist{found}. Fix: point it at a step-N folder of another run"
    if not os.path.isfile(os.path.join(path, files.DCP_METADATA)):
        steps = sorted(files.scan(path).complete)
        if steps:
            return (f"{where} is a run's checkpoint folder, not one checkpoint. Fix: choose one of its steps, "
                    f"e.g. the newest: {os.path.join(path, f'step-{steps[-1]}')}")
        return (f"{where} is not a DCP checkpoint folder (no {files.DCP_METADATA} in it). Fix: point it at a "
                "step-N folder of another run, or at a folder written by scripts/convert_checkpoint.py from-torch")
    return None


def _candidate(step: int, path: str) -> Candidate:
    problem = files.incomplete_reason(path)
    marker = files.read_marker(path) if problem is None else None
    return Candidate(path, step, bool((marker or {}).get("model_only")), marker, problem)


def damaged_line(candidate: Candidate, problem: str) -> str:
    """The warning that names a damaged checkpoint, the file and the reason."""
    return f"checkpoint {candidate.path} is damaged: {problem}"


def refusal(plan: LoadPlan, problem: str) -> str:
    """The error when the checkpoint a setting names is damaged."""
    return f"{plan.setting} is damaged: {problem}. Fix: restore it from a copy, or {plan.fix}"


def fallback_line(candidate: Candidate, skipped: list[Candidate]) -> str:
    """The line saying that the run resumes from an earlier checkpoint than the newest."""
    names = ", ".join(f"step-{c.step}" for c in skipped)
    return (f"falling back to checkpoint step-{candidate.step}, the newest that verifies: steps "
            f"{candidate.step + 1}-{skipped[0].step} are trained again; the damaged {names} "
            f"{'is' if len(skipped) == 1 else 'are'} left in place until this run saves that step again")


def all_damaged(folder: str, damaged: list[tuple[Candidate, str]]) -> str:
    """The error when every checkpoint of the folder is damaged (the run refuses to start over)."""
    listed = "; ".join(f"step-{c.step}: {problem}" for c, problem in damaged[:3])
    if len(damaged) > 3:
        listed += f"; and {len(damaged) - 3} older"
    return (f"every checkpoint in {folder!r} is damaged ({listed}); the run does not start over while they "
            "exist. Fix: restore one from a copy, or move the folder away (or set job.dump_folder) to "
            "start from step 0")
