"""The parity sweep behind ``./scripts/parity.py``: the one-process reference, then every layout, each
compared with it (engine/parity/compare.py), with clipping engaged.

Clipping: a layout that reduces the grad norm wrongly (a missing mesh in the sum) only changes the
trained weights when the norm is clipped. When no step of the reference clips (every grad norm under
``training.max_norm``) the sweep says so, with a ``max_norm`` that would clip some steps
(:func:`engine.parity.compare.engaging_max_norm`), and by default runs the reference again and every
layout with it (``engage_clipping=False`` keeps the config's and only reports).
"""

from __future__ import annotations

import os
import shutil
import time

from engine.parity.compare import (TOLERANCES, clipping_sides, engaging_max_norm, history_differences,
                                   parameter_differences)
from engine.parity.layouts import REFERENCE, Layout, parse_layout
from engine.parity.noise import MARGIN, REORDER, kernel_twin_env, history_floor, step_tolerances, tolerance_of
from engine.parity.runs import launch, parity_overrides

PRECISIONS = {"fp32": "float32", "fp64": "float64"}


def _weights(result):
    if result.checkpoint is None:
        return None
    from engine.convert.tools import load_model_weights

    return load_model_weights(result.checkpoint)


class Sweep:
    """One parity sweep (see the module docstring).

    Args:
        base_argv: the user's config arguments (``--job.config_file PATH``, ``--section.key value``);
        steps: steps per run; precision: "float32" or "float64"; folder: where the run folders go;
        engage_clipping: re-run with a clipping ``max_norm`` when the config's clips no step;
        replay: the runs resume a checkpoint (``base_argv`` names it) and stop after step ``steps``;
        say: a function printing one line of progress; env: extra environment for the ranks;
        noise_floor: judge every layout against the reference's measured noise floor
            (engine/parity/noise.py) instead of ``precision``'s fixed tolerances; device_type: "cpu"
            adds the other-kernel twin; local_batch_size: < 2 leaves out the reordered twin.
    """

    def __init__(self, base_argv: list[str], steps: int, precision: str, folder: str, *,
                 engage_clipping: bool = True, say=print, env: dict | None = None, replay: bool = False,
                 locate_from: int = 0, noise_floor: bool = False, device_type: str = "cpu",
                 local_batch_size: int = 2):
        self.base_argv, self.steps, self.precision, self.folder = list(base_argv), steps, precision, folder
        self.noise_floor, self.device_type, self.local_batch_size = noise_floor, device_type, local_batch_size
        self.floor: list[float] = []  # F_s per step (engine/parity/noise.py); empty: fixed tolerances
        self.parameter_floor = 0.0
        self.twins: dict[str, list] = {}  # twin name: its history
        self.twin_floors: dict[str, float] = {}  # twin name: its worst difference from the reference
        self.engage_clipping, self.say, self.env, self.replay = engage_clipping, say, env, replay
        self.extra: dict = {}  # overrides the sweep adds to every run (training.max_norm)
        # --locate: every run records its first step (``locate_from``, 1-based); the reference also
        # keeps a checkpoint of every step, the start of a later failing step's re-runs.
        self.locate_from = locate_from
        if locate_from:
            self.extra["record.step"] = locate_from
        self._located_references: dict[int, str] = {}
        self.reference = None
        self.reference_weights = None
        self.clipping: dict = {}

    def _run(self, layout: Layout, tag: str, more: dict | None = None, env: dict | None = None):
        overrides = {**layout.overrides, **self.extra,
                     **parity_overrides(os.path.join(self.folder, tag), self.steps, self.replay), **(more or {})}
        return launch(self.base_argv, overrides, layout.world_size, os.path.join(self.folder, tag),
                      env={**(self.env or {}), **(env or {})})

    def measure_floor(self) -> dict:
        """Train the reference's twins (engine/parity/noise.py) and set :attr:`floor` and
        :attr:`parameter_floor`; returns {twin name: its worst relative difference from the reference}.

        Raises:
            RuntimeError: no twin applies (local_batch_size 1 on a GPU), or a twin's run failed.
        """
        twins = {}
        if self.local_batch_size >= 2:
            twins["reordered sequences"] = (REORDER, None)
        if self.device_type == "cpu":
            twins["other CPU kernels"] = ({}, kernel_twin_env())
        if not twins:
            raise RuntimeError("no noise-floor twin applies: the reordered-sequence twin needs "
                               "training.local_batch_size >= 2 (the kernel twin runs on the CPU only)")
        worst = {}
        for index, (name, (more, env)) in enumerate(twins.items()):
            run = self._run(parse_layout(REFERENCE), f"noise_twin_{index}", {**self._reference_more(), **more}, env)
            if run.error:
                raise RuntimeError(f"the noise-floor twin ({name}) failed: {run.error}")
            self.twins[name] = run.history
            worst[name] = history_floor(self.reference.history, [run.history])[-1]
            weights = _weights(run)
            if weights is not None and self.reference_weights is not None:
                self.parameter_floor = max(self.parameter_floor, parameter_differences(weights, self.reference_weights)[0])
        self.floor = history_floor(self.reference.history, list(self.twins.values()))
        self.twin_floors = worst
        return worst

    def _reference_more(self) -> dict:
        return {"checkpoint.interval": 1, "checkpoint.keep_latest_k": 0} if self.locate_from else {}

    def run_reference(self, max_norm: float) -> dict:
        """Train the one-process reference (twice when clipping has to be engaged); returns the
        ``clipping`` record: {"max_norm", "clipped_steps", "unclipped_steps", "engaged", "note"}.

        Raises:
            RuntimeError: the reference run failed (its launcher's last lines).
        """
        reference = parse_layout(REFERENCE)
        self.reference = self._run(reference, "reference", self._reference_more())
        if self.reference.error:
            raise RuntimeError(f"the one-process reference failed: {self.reference.error}")
        clipped, unclipped = clipping_sides(self.reference.history, max_norm)
        note = ""
        if clipped == 0:
            suggested = engaging_max_norm(self.reference.history)
            norms = [n for _, n in self.reference.history]
            note = (f"clipping not engaged: every grad norm ({min(norms):.4g} to {max(norms):.4g}) is under "
                    f"training.max_norm {max_norm:g}; training.max_norm {suggested:g} would engage it")
            self.say(note)
            if self.engage_clipping:
                self.extra["training.max_norm"] = suggested
                max_norm = suggested
                self.say(f"running the reference and every layout with --training.max_norm {suggested:g}")
                self.reference = self._run(reference, "reference_clipped", self._reference_more())
                if self.reference.error:
                    raise RuntimeError(f"the one-process reference failed: {self.reference.error}")
                clipped, unclipped = clipping_sides(self.reference.history, max_norm)
        self.reference_weights = _weights(self.reference)
        self.clipping = {"max_norm": max_norm, "clipped_steps": clipped, "unclipped_steps": unclipped,
                         "engaged": clipped > 0, "note": note}
        if self.noise_floor:
            self.measure_floor()
        return self.clipping

    def compare(self, layout: Layout) -> dict:
        """Train ``layout`` and compare it with the reference; returns its report row."""
        start = time.perf_counter()
        result = self._run(layout, layout.name.replace(":", "_"))
        row = {"layout": layout.name, "world_size": layout.world_size, "overrides": {**layout.overrides, **self.extra},
               "history": result.history, "seconds": round(result.seconds, 1), "error": result.error}
        tolerances = step_tolerances(self.floor) if self.floor else None
        diffs = history_differences(result.history, self.reference.history, self.precision, tolerances)
        row.update(diffs)
        if self.floor:
            row.update(floor=self.floor[-1], parameter_floor=self.parameter_floor)
        weights = _weights(result) if not result.error else None
        if weights is not None and self.reference_weights is not None:
            worst, name, missing = parameter_differences(weights, self.reference_weights)
            row.update(params=worst, params_tensor=name, params_missing=missing)
            limit = tolerance_of(self.parameter_floor) if self.floor else TOLERANCES[self.precision][1]
            params_ok = not missing and worst <= limit
        else:
            row.update(params=None, params_tensor=None, params_missing=[])
            params_ok = False
        row["passed"] = bool(diffs["passed"] and params_ok and not result.error)
        if self.locate_from and not row["passed"] and not result.error:
            row["locate"] = self.locate(layout, result.folder, diffs["first_failing_step"] or len(result.history))
        if self.locate_from:  # a step's records are large (every module's input and output): keep none
            shutil.rmtree(os.path.join(result.folder, "record"), ignore_errors=True)
        row["seconds_total"] = round(time.perf_counter() - start, 1)
        return row

    def locate(self, layout: Layout, run_folder: str, failing: int) -> dict:
        """The locator's findings (engine/parity/locate.py) for ``layout`` at its ``failing`` step
        (1-based within the sweep's steps): the records of the runs themselves when it is the first
        step, else re-runs of that step by the layout and by one process, both resuming the one
        process's checkpoint of the step before (resume is exact, so they start from the same
        weights, optimizer state and data position)."""
        from engine.parity.locate import locate

        step = self.locate_from + failing - 1
        if failing == 1:
            reference, layout_folder = os.path.join(self.reference.folder, "record"), os.path.join(run_folder, "record")
            start = "both from initialization" if not self.replay else "both from the replayed checkpoint"
        else:
            resume = {"checkpoint.initial_load_path": os.path.join(self.reference.folder, "checkpoint", f"step-{step - 1}"),
                      "checkpoint.initial_load_model_only": "false", "training.stop_after_step": step,
                      "record.step": step}
            start = f"both from one process's checkpoint step-{step - 1}"
            if step not in self._located_references:
                ref = self._run(parse_layout(REFERENCE), f"locate_reference_{step}", resume)
                if ref.error:
                    return {"step": step, "error": f"the one-process re-run of step {step} failed: {ref.error}"}
                self._located_references[step] = os.path.join(ref.folder, "record")
            reference = self._located_references[step]
            rerun = self._run(layout, f"locate_{layout.name.replace(':', '_')}_{step}", resume)
            if rerun.error:
                return {"step": step, "error": f"the re-run of step {step} failed: {rerun.error}"}
            layout_folder = os.path.join(rerun.folder, "record")
        found = {**locate(layout_folder, reference, self.precision), "start": start}
        if failing != 1:
            shutil.rmtree(layout_folder, ignore_errors=True)
        return found


def original_row(run_folder: str, sweep: Sweep, start_step: int) -> dict:
    """The report row of a replayed run's own metrics.jsonl (steps after ``start_step``) against the
    one-process replay: whether the data and numerics of those steps come back (no parameters: the
    run may not have saved at the step)."""
    from engine.parity.runs import read_history

    history = read_history(run_folder, first_step=start_step + 1)[:len(sweep.reference.history)]
    diffs = history_differences(history, sweep.reference.history, sweep.precision,
                                step_tolerances(sweep.floor) if sweep.floor else None)
    return {"layout": "original run", "world_size": "-", "history": history, "seconds": 0.0, "error": None,
            **diffs, "params": None, "params_tensor": None, "params_missing": [], "passed": diffs["passed"]}


def progress_line(row: dict) -> str:
    """One line per finished layout: verdict, worst differences, seconds."""
    def number(key):
        return "n/a" if row.get(key) is None else f"{row[key]:.2e}"
    floor = f"  (floor: steps {number('floor')}, params {number('parameter_floor')})" if "floor" in row else ""
    return (f"{row['layout']}: {'pass' if row['passed'] else 'FAIL'}  loss {number('loss')}  grad_norm "
            f"{number('grad_norm')}  params {number('params')}{floor}  ({row['seconds']:.0f} s)")


def format_table(rows: list[dict], precision: str, sweep: Sweep | None = None) -> str:
    """The report table: per layout the worst relative difference of loss, grad norm (with its step)
    and final parameters, pass/fail at ``precision``'s tolerance (or, when ``sweep`` measured a noise
    floor, against that floor, shown in its own column) and the run's seconds."""
    first, later = TOLERANCES[precision]
    floor = sweep.floor if sweep is not None else []
    head = ("layout", "procs", "loss rel diff", "grad_norm rel diff", "params rel diff",
            *(("floor (steps / params)",) if floor else ()), "result", "time")
    lines = [head]
    for row in rows:
        def cell(key):
            value = row.get(key)
            step = row.get(f"{key}_step")
            return "n/a" if value is None else f"{value:.2e}" + (f" (step {step})" if step else "")
        verdict = "pass" if row["passed"] else ("FAIL: run failed" if row.get("error") else
                                                 f"FAIL (step {row['first_failing_step']})"
                                                 if row.get("first_failing_step") else "FAIL (params)")
        floor_cell = (f"{floor[-1]:.2e} / {sweep.parameter_floor:.2e}",) if floor else ()
        lines.append((row["layout"], str(row["world_size"]), cell("loss"), cell("grad_norm"), cell("params"),
                      *floor_cell, verdict, f"{row['seconds']:.0f} s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    if floor:
        steps = ", ".join(f"{value:.1e}" for value in floor)
        text.append(f"tolerance (noise floor, engine/parity/noise.py): {MARGIN:g} x max(floor, 2^-23), the floor "
                    f"being the largest relative difference of the reference's twins ({', '.join(sweep.twins)}) "
                    f"up to each step ({steps}) and of their final parameters ({sweep.parameter_floor:.1e}; "
                    f"max|a-b| / max|b| per tensor)")
    else:
        text.append(f"tolerance ({precision}): relative {first:g} at step 1, {later:g} at later steps and for "
                    f"the final parameters (max|a-b| / max|b| per tensor)")
    return "\n".join(text)
