"""The parity sweep behind ``./scripts/parity.py``: the one-process reference, then every layout, each
compared with it (engine/parity/compare.py), with clipping engaged.

Noise floor (``noise_floor=True``, engine/parity/noise.py): the reference's twins are trained after it
and every layout is judged against their measured floor. Under float8 (``match_microbatches``) the
activations' tensorwise scales are taken over the tokens of one forward, so a layout is compared with
a one-process reference that forwards as many sequences at a time as each of its ranks does (fsdp2 of
a batch of 8: microbatches of 4, the same global batch), trained with its own twins when that is not
the config's local batch; a context-parallel layout, whose ranks scale half of each sequence, also
has that reference's run in microbatches of half the size as a twin (the same change of which tokens
share a scale; no float order gives it).

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
from dataclasses import dataclass, field

from engine.parity.compare import (TOLERANCES, clipping_sides, engaging_max_norm, history_differences,
                                   parameter_differences)
from engine.parity.layouts import REFERENCE, ParityLayout, parse_layout
from engine.parity.noise import MARGIN, REORDER, kernel_twin_env, history_floor, step_tolerances, tolerance_of
from engine.parity.runs import launch, parity_overrides

PRECISIONS = {"fp32": "float32", "fp64": "float64"}


@dataclass
class Reference:
    """A one-process reference and what a layout is judged by against it.

    Attributes:
        run: its RunResult; weights: its final parameters {name: tensor} or None; microbatch: the
        sequences it forwards at a time; floor: the noise floor per step (empty: the fixed
        tolerances); parameter_floor: its twins' final parameter difference; twins: {name: history};
        twin_floors: {name: that twin's worst difference}.
    """

    run: object
    weights: dict | None
    microbatch: int
    floor: list = field(default_factory=list)
    parameter_floor: float = 0.0
    twins: dict = field(default_factory=dict)
    twin_floors: dict = field(default_factory=dict)


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
            adds the other-kernel twin; local_batch_size: the config's (< 2 leaves out the reordered
            twin); pp_microbatch_size: the config's; match_microbatches: float8 (module docstring).
    """

    def __init__(self, base_argv: list[str], steps: int, precision: str, folder: str, *,
                 engage_clipping: bool = True, say=print, env: dict | None = None, replay: bool = False,
                 locate_from: int = 0, noise_floor: bool = False, device_type: str = "cpu",
                 local_batch_size: int = 2, pp_microbatch_size: int = 1, match_microbatches: bool = False):
        self.base_argv, self.steps, self.precision, self.folder = list(base_argv), steps, precision, folder
        self.noise_floor, self.device_type, self.local_batch_size = noise_floor, device_type, local_batch_size
        self.pp_microbatch_size, self.match_microbatches = pp_microbatch_size, match_microbatches
        self.references: dict[int, Reference] = {}  # by the sequences a reference forwards at a time
        self._regrouped: dict[int, object] = {}  # microbatch: the run in half-size microbatches (cp twin)
        self.engage_clipping, self.say, self.env, self.replay = engage_clipping, say, env, replay
        self.extra: dict = {}  # overrides the sweep adds to every run (training.max_norm)
        # --locate: every run records its first step (``locate_from``, 1-based); the reference also
        # keeps a checkpoint of every step, the start of a later failing step's re-runs.
        self.locate_from = locate_from
        if locate_from:
            self.extra["record.step"] = locate_from
        self._located_references: dict[int, str] = {}
        self.clipping: dict = {}

    def _run(self, layout: ParityLayout, tag: str, more: dict | None = None, env: dict | None = None):
        overrides = {**layout.overrides, **self.extra,
                     **parity_overrides(os.path.join(self.folder, tag), self.steps, self.replay), **(more or {})}
        return launch(self.base_argv, overrides, layout.world_size, os.path.join(self.folder, tag),
                      env={**(self.env or {}), **(env or {})})

    def _one_process(self, tag: str, what: str, more: dict | None = None, env: dict | None = None):
        """Train one process (the reference layout) with the reference's overrides and ``more``.

        Raises:
            RuntimeError: the run failed: "``what`` failed: <its launcher's last lines>".
        """
        run = self._run(parse_layout(REFERENCE), tag, {**self._reference_more(), **(more or {})}, env)
        if run.error:
            raise RuntimeError(f"{what} failed: {run.error}")
        return run

    # the config's reference and its floor (what the report shows)
    main = property(lambda self: self.references.get(self.local_batch_size))
    reference = property(lambda self: self.main.run if self.main else None)
    reference_weights = property(lambda self: self.main.weights if self.main else None)
    floor = property(lambda self: self.main.floor if self.main else [])
    parameter_floor = property(lambda self: self.main.parameter_floor if self.main else 0.0)
    twins = property(lambda self: self.main.twins if self.main else {})
    twin_floors = property(lambda self: self.main.twin_floors if self.main else {})

    def measure_floor(self, reference: Reference, more: dict | None = None) -> None:
        """Train ``reference``'s twins (engine/parity/noise.py; ``more``: the reference's own
        overrides) and set its floor, parameter floor and twins.

        Raises:
            RuntimeError: no twin applies (one sequence per microbatch on a GPU), or a twin's run failed.
        """
        twins = {}
        if reference.microbatch >= 2:
            twins["reordered sequences"] = (REORDER, None)
        else:
            self.say(f"noise floor: one sequence per microbatch ({reference.microbatch}) leaves nothing to reorder: "
                     "no reordered-sequence twin")
        if self.device_type == "cpu":
            twins["other CPU kernels"] = ({}, kernel_twin_env())
        if not twins:
            raise RuntimeError("no noise-floor twin applies: the reordered-sequence twin needs "
                               "training.local_batch_size >= 2 (the kernel twin runs on the CPU only)")
        for index, (name, (twin_more, env)) in enumerate(twins.items()):
            tag = f"noise_twin_{index}" + ("" if reference is self.main else f"_mb{reference.microbatch}")
            run = self._one_process(tag, f"the noise-floor twin ({name})", {**(more or {}), **twin_more}, env)
            reference.twins[name] = run.history
            reference.twin_floors[name] = history_floor(reference.run.history, [run.history])[-1]
            weights = _weights(run)
            if weights is not None and reference.weights is not None:
                reference.parameter_floor = max(reference.parameter_floor,
                                                parameter_differences(weights, reference.weights)[0])
        reference.floor = history_floor(reference.run.history, list(reference.twins.values()))

    def forward_batch(self, layout: ParityLayout) -> int:
        """Sequences each rank of ``layout`` forwards at a time: its pipeline microbatch under pp, else
        its local batch (fitted to its dp degree, engine/parity/layouts.py's fit_batch)."""
        o = layout.overrides
        if int(o.get("parallelism.pp", 1)) > 1:
            return int(o.get("parallelism.pp_microbatch_size", self.pp_microbatch_size))
        return int(o.get("training.local_batch_size", self.local_batch_size))

    def reference_for(self, layout: ParityLayout) -> tuple[Reference, list[float]]:
        """(the one-process reference ``layout`` is judged against, its floor for this layout): the
        config's, or under float8 the one forwarding as many sequences at a time (trained on first
        use, with its twins), a cp layout's floor widened by the regrouped run (module docstring).

        Raises:
            RuntimeError: a reference or twin run failed.
        """
        microbatch = self.forward_batch(layout) if self.match_microbatches else self.local_batch_size
        reference = self.references.get(microbatch)
        more = {"training.local_batch_size": microbatch}
        if reference is None:
            self.say(f"float8: {layout.name}'s ranks forward {microbatch} sequences at a time (activation scales "
                     f"are per forward): one process in microbatches of {microbatch} is its reference")
            run = self._one_process(f"reference_mb{microbatch}",
                                    f"the one-process reference in microbatches of {microbatch}", more)
            reference = self.references[microbatch] = Reference(run, _weights(run), microbatch)
            if self.noise_floor:
                self.measure_floor(reference, more)
        floor = reference.floor
        if floor and self.match_microbatches and int(layout.overrides.get("parallelism.cp", 1)) > 1 and microbatch >= 2:
            half = microbatch // 2
            if half not in self._regrouped:
                self._regrouped[half] = self._one_process(f"regrouped_mb{half}",
                                                          f"the one-process run in microbatches of {half}",
                                                          {"training.local_batch_size": half})
            floor = history_floor(reference.run.history, [*reference.twins.values(), self._regrouped[half].history])
        return reference, floor

    def _reference_more(self) -> dict:
        return {"checkpoint.interval": 1, "checkpoint.keep_latest_k": 0} if self.locate_from else {}

    def run_reference(self, max_norm: float) -> dict:
        """Train the one-process reference (twice when clipping has to be engaged); returns the
        ``clipping`` record: {"max_norm", "clipped_steps", "unclipped_steps", "engaged", "note"}.

        Raises:
            RuntimeError: the reference run failed (its launcher's last lines).
        """
        run = self._one_process("reference", "the one-process reference")
        clipped, unclipped = clipping_sides(run.history, max_norm)
        note = ""
        if clipped == 0:
            suggested = engaging_max_norm(run.history)
            norms = [n for _, n in run.history]
            note = (f"clipping not engaged: every grad norm ({min(norms):.4g} to {max(norms):.4g}) is under "
                    f"training.max_norm {max_norm:g}; training.max_norm {suggested:g} would engage it")
            self.say(note)
            if self.engage_clipping:
                self.extra["training.max_norm"] = suggested
                max_norm = suggested
                self.say(f"running the reference and every layout with --training.max_norm {suggested:g}")
                run = self._one_process("reference_clipped", "the one-process reference")
                clipped, unclipped = clipping_sides(run.history, max_norm)
        self.references[self.local_batch_size] = Reference(run, _weights(run), self.local_batch_size)
        self.clipping = {"max_norm": max_norm, "clipped_steps": clipped, "unclipped_steps": unclipped,
                         "engaged": clipped > 0, "note": note}
        if self.noise_floor:
            self.measure_floor(self.main)
        return self.clipping

    def compare(self, layout: ParityLayout) -> dict:
        """Train ``layout`` and compare it with its reference (:meth:`reference_for`); returns its
        report row (with ``floor``, ``parameter_floor`` and ``reference_microbatch`` under a noise floor)."""
        start = time.perf_counter()
        reference, floor = self.reference_for(layout)
        result = self._run(layout, layout.name.replace(":", "_"))
        row = {"layout": layout.name, "world_size": layout.world_size, "overrides": {**layout.overrides, **self.extra},
               "history": result.history, "seconds": round(result.seconds, 1), "error": result.error}
        tolerances = step_tolerances(floor) if floor else None
        diffs = history_differences(result.history, reference.run.history, self.precision, tolerances)
        row.update(diffs)
        if floor:
            row.update(floor=floor[-1], parameter_floor=reference.parameter_floor,
                       reference_microbatch=reference.microbatch)
        weights = _weights(result) if not result.error else None
        if weights is not None and reference.weights is not None:
            worst, name, missing = parameter_differences(weights, reference.weights)
            row.update(params=worst, params_tensor=name, params_missing=missing)
            limit = tolerance_of(reference.parameter_floor) if floor else TOLERANCES[self.precision][1]
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

    def locate(self, layout: ParityLayout, run_folder: str, failing: int) -> dict:
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
            previous = os.path.join(self.reference.folder, "checkpoint", f"step-{step - 1}")
            resume = {"checkpoint.initial_load_path": previous,
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
    floored = any("floor" in row for row in rows)
    head = ("layout", "procs", "loss rel diff", "grad_norm rel diff", "params rel diff",
            *(("floor (steps / params)",) if floored else ()), "result", "time")
    lines = [head]
    for row in rows:
        def cell(key):
            value = row.get(key)
            step = row.get(f"{key}_step")
            return "n/a" if value is None else f"{value:.2e}" + (f" (step {step})" if step else "")
        verdict = "pass" if row["passed"] else ("FAIL: run failed" if row.get("error") else
                                                 f"FAIL (step {row['first_failing_step']})"
                                                 if row.get("first_failing_step") else "FAIL (params)")
        mb = row.get("reference_microbatch")
        mb = f" (mb {mb})" if mb is not None and sweep is not None and mb != sweep.local_batch_size else ""
        floor_cell = ((f"{row['floor']:.2e} / {row['parameter_floor']:.2e}{mb}" if "floor" in row else "n/a",)
                      if floored else ())
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
                    f"max|a-b| / max|b| per tensor)" + (
                        "; (mb N): judged against one process forwarding N sequences at a time, as each of "
                        "the layout's ranks does (float8 scales activations per forward), with its own twins"
                        if sweep.match_microbatches else ""))
    else:
        text.append(f"tolerance ({precision}): relative {first:g} at step 1, {later:g} at later steps and for "
                    f"the final parameters (max|a-b| / max|b| per tensor)")
    return "\n".join(text)
