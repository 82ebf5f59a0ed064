"""Short runs of the tests' tiny model for tests/integration/test_fingerprint_behaviour.py, and their comparison.

A :class:`Run` is a set of config overrides (on top of :data:`SETTING`), a world size, step faults to
inject (engine/testing/faults.py) and a checkpoint to resume. :func:`train_runs` trains a list of
runs in turn inside one process (or the same forked ranks): a fresh Trainer each, no launcher, so a run
costs its start-up (~0.3 s) and 3 steps. Each run leaves ``params-rank<r>.pt`` (its full parameters,
unwrapped names) in its folder; :func:`compare` reads them back in the test process, so no weights
cross the process boundary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass

from engine.parity.compare import history_differences, parameter_differences, tolerance
from tests.training_utils import LR, base_args

STEPS = 3
# On top of tests/training_utils.base_args: 3 steps of 8 sequences of 16 tokens; the LR is nonzero at
# every step (warmup 1, then linear decay to LR / 10), so that every update moves the weights (a key
# that changes only the last update still changes the final parameters); clipping off (the grad
# norms are 0.76-0.80 at these settings); no validation unless a key turns it on.
SETTING = {
    "training.steps": STEPS, "training.seq_len": 16, "lr_scheduler.warmup_steps": 1,
    "lr_scheduler.decay_type": "linear", "lr_scheduler.min_lr": LR / 10, "training.max_norm": 1.0,
    "validation.enable": "false",
}
FP64 = {"training.mixed_precision_param": "float64", "training.mixed_precision_reduce": "float64"}
# Placeholders in override values, replaced in the run: this run's folder, the checkpoint source's,
# the folder of the test's own files (corpora, a config file, a tokenizer).
RUN_FOLDER, SOURCE_FOLDER, FILES_FOLDER = "@run", "@source", "@files"


@dataclass(frozen=True)
class Run:
    """One short run.

    Attributes:
        overrides: ((key, value as text), ...) sorted, on top of :data:`SETTING`.
        world_size: processes (1: no process group).
        inject: ((1-based step, kind of engine/testing/faults.KINDS), ...).
        resume: > 0: copy the checkpoints of steps 1..resume of :data:`SOURCE` into the run's
            checkpoint folder before it starts (the run resumes one of them).
    """

    overrides: tuple = ()
    world_size: int = 1
    inject: tuple = ()
    resume: int = 0

    @property
    def name(self) -> str:
        return hashlib.sha1(repr(self).encode()).hexdigest()[:12]

    @property
    def settings(self) -> dict:
        return dict(self.overrides)

    def with_overrides(self, more: dict) -> "Run":
        return run_of({**self.settings, **more}, self.world_size, dict(self.inject), self.resume)


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def run_of(overrides: dict, world_size: int = 1, inject: dict | None = None, resume: int = 0) -> Run:
    """The :class:`Run` of ``{"section.key": value}`` overrides (values as TOML/CLI text)."""
    return Run(tuple(sorted((key, _text(value)) for key, value in overrides.items())), world_size,
               tuple(sorted((inject or {}).items())), resume)


# Checkpoints of every step of the default run: initial_load_path and load_step read them.
SOURCE = run_of({"checkpoint.enable": True, "checkpoint.interval": 1})


def _params(trainer) -> dict:
    """{unwrapped name: full tensor} of this rank's parameters (every rank takes part in the gathers)."""
    from torch.distributed.tensor import DTensor

    from engine.observe.record import clean_name

    out = {}
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[clean_name(name)] = full.detach().cpu().clone()
    return out


def run_config(root: str, run: Run):
    """The validated JobConfig of ``run`` (placeholders replaced)."""
    from engine.config import load_config

    folder = os.path.join(root, run.name)
    places = {RUN_FOLDER: folder, SOURCE_FOLDER: os.path.join(root, SOURCE.name), FILES_FOLDER: files_folder(root)}
    overrides = dict(SETTING)
    for key, value in run.overrides:
        for place, path in places.items():
            value = value.replace(place, path)
        overrides[key] = value
    cfg = load_config(base_args(folder, overrides))
    cfg.validate()
    return cfg


def files_folder(root: str) -> str:
    return os.path.join(root, "files")


def train_one(root: str, run: Run) -> dict:
    """Train ``run`` in its folder under ``root``: {"history": [(step, loss, grad_norm)], "error": the
    first line of the TrainingDivergedError that stopped it, or None}; saves this rank's parameters
    as params-rank<r>.pt (a run that stopped saves none)."""
    import torch

    from engine.train.trainer import Trainer, TrainingDivergedError
    from engine.testing.faults import inject

    folder = os.path.join(root, run.name)
    if run.resume:
        for step in range(1, run.resume + 1):
            name = f"step-{step}"
            target = os.path.join(folder, "checkpoint", name)
            if not os.path.isdir(target):
                shutil.copytree(os.path.join(root, SOURCE.name, "checkpoint", name), target)
    trainer = Trainer(run_config(root, run))
    if run.inject:
        inject(trainer, dict(run.inject))
    error, finished = None, False
    try:
        trainer.train(steps=max(0, STEPS - trainer.step))
        finished = True
    except TrainingDivergedError as exc:  # step_health stops the run: a result (any other error fails the test)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        trainer.close(wait=finished)  # a checkpoint in flight may need ranks that failed
    if finished:
        torch.save(_params(trainer), os.path.join(folder, f"params-rank{trainer.dist.rank}.pt"))
    return {"history": [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.history], "error": error}


def train_runs(root: str, runs: list[Run]) -> dict[str, dict | str]:
    """:func:`train_one` of each run in turn: {run name: its result, or the traceback of a run that
    failed to build}. After a failure in ranks of a process group the rest are not run."""
    import traceback

    out: dict[str, dict | str] = {}
    broken = None
    for run in runs:
        if broken is not None:
            out[run.name] = f"not run: {broken} failed before it in the same ranks"
            continue
        try:
            out[run.name] = train_one(root, run)
        except Exception:  # noqa: BLE001 - reported by the key's test
            out[run.name] = traceback.format_exc()
            if run.world_size > 1:
                broken = run.name
    return out


def load_params(root: str, run: Run) -> dict:
    """{name: tensor} of a trained run, merged over its ranks (a pipeline rank holds its stages)."""
    import torch

    out: dict = {}
    folder = os.path.join(root, run.name)
    for rank in range(run.world_size):
        path = os.path.join(folder, f"params-rank{rank}.pt")
        if os.path.exists(path):
            for name, tensor in torch.load(path, weights_only=True).items():
                out.setdefault(name, tensor)
    return out


@dataclass
class Difference:
    """How a run differs from another: ``bitwise`` (the losses and grad norms of the common steps and,
    when both runs end at the same step, the parameters are exactly equal), ``within`` (within ``precision``'s tolerance of engine/parity/compare.py
    over the common steps, and the parameters when both end at the same step) and ``detail``."""

    bitwise: bool
    within: bool
    detail: str


def compare(got: dict, want: dict, got_params: dict, want_params: dict, precision: str) -> Difference:
    """:class:`Difference` of result ``got`` from ``want`` (results of :func:`train_one`)."""
    if got["error"] != want["error"]:
        return Difference(False, False, f"stopped with {got['error']!r} vs {want['error']!r}")
    mine = {step: (loss, norm) for step, loss, norm in got["history"]}
    theirs = {step: (loss, norm) for step, loss, norm in want["history"]}
    common = sorted(set(mine) & set(theirs))
    if not common:
        return Difference(False, False, f"no common step: {sorted(mine)} vs {sorted(theirs)}")
    history = history_differences([mine[s] for s in common], [theirs[s] for s in common], precision)
    same_end = max(mine) == max(theirs)  # else the parameters belong to different steps
    worst, name, missing = parameter_differences(got_params, want_params) if same_end else (0.0, None, [])
    exact = (all(mine[s] == theirs[s] for s in common) and not missing
             and (not same_end or all(got_params[n].dtype == want_params[n].dtype
                                      and got_params[n].equal(want_params[n]) for n in want_params)))
    within = history["passed"] and not missing and worst <= tolerance(max(common), precision)
    where = {key: common[history[f"{key}_step"] - 1] for key in ("loss", "grad_norm")}
    detail = (f"steps {sorted(mine)} vs {sorted(theirs)}: loss {history['loss']:.3g} (step {where['loss']}), "
              f"grad norm {history['grad_norm']:.3g} (step {where['grad_norm']}); "
              + (f"parameters {worst:.3g} ({name})" if same_end else "parameters of different steps"))
    return Difference(exact, within, detail + (f"; only on one side: {missing}" if missing else ""))


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Spec:
    """How a key is exercised: ``change`` (its other value, with what it needs to act) applied on top
    of ``context`` (the settings of both runs), on ``world_size`` processes, with the step faults
    ``inject`` and the checkpoint ``resume`` of :class:`Run` (the changed run only). Execution keys of
    one ``family`` (and context, world size, faults, resume) change together in one run; keys whose
    changes would conflict or cancel get different families. ``loader``: the key changes the data, so
    the convergence check may compare the first steps' tokens of the two loaders instead of training."""

    change: dict
    context: dict | None = None
    world_size: int = 1
    inject: dict | None = None
    resume: int = 0
    family: str = "main"
    loader: bool = False


def _frozen(d: dict | None) -> tuple:
    return tuple(sorted((k, _text(v)) for k, v in (d or {}).items()))


def reference_run(spec: Spec, precision: str) -> Run:
    """The run ``spec``'s key is compared with, whatever its class: the default setting plus the
    context, in ``precision``, on one process (a layout's default value on 2 processes would need
    another batch split)."""
    return run_of({**(spec.context or {}), **(FP64 if precision == "float64" else {})}, 1, spec.inject)


def changed_run(spec: Spec, precision: str) -> Run:
    """The run with the key's change (in ``precision``)."""
    return run_of({**(spec.context or {}), **spec.change, **(FP64 if precision == "float64" else {})},
                  spec.world_size, spec.inject, spec.resume)


def group_runs(specs: dict[str, Spec], keys: list[str], precision_of) -> dict[str, Run]:
    """{key: the run of its group}: the changes of the given execution keys merged per (family,
    context, world size, faults, resume, precision).

    Raises:
        ValueError: two keys of one group set one key to different values (give them two families).
    """
    groups: dict[tuple, list[str]] = {}
    for key in keys:
        spec = specs[key]
        groups.setdefault((spec.family, _frozen(spec.context), spec.world_size, _frozen(spec.inject), spec.resume,
                           precision_of(key)), []).append(key)
    out = {}
    for (_, _, world_size, _, resume, precision), members in groups.items():
        merged: dict = {}
        for key in members:
            for name, value in specs[key].change.items():
                if name in merged and _text(merged[name]) != _text(value):
                    raise ValueError(f"{key} sets {name} = {value!r}, another key of its family {merged[name]!r}")
                merged[name] = value
        spec = specs[members[0]]
        run = changed_run(Spec(merged, spec.context, world_size, spec.inject, resume), precision)
        out.update({key: run for key in members})
    return out


class Lab:
    """Trains runs on demand, each once (all runs asked for at once share one forked process per
    world size), and compares them. ``root``: the folder of the run folders and the test's files."""

    def __init__(self, root: str):
        self.root = root
        self.results: dict[str, dict | str] = {}

    def train(self, runs) -> None:
        todo = [run for run in dict.fromkeys(runs) if run.name not in self.results]
        needs_source = any(run.resume or any(SOURCE_FOLDER in value for _, value in run.overrides) for run in todo)
        if needs_source and SOURCE.name not in self.results:
            todo = [SOURCE] + [run for run in todo if run != SOURCE]
        from engine.testing.processes import run_distributed

        for world_size in sorted({run.world_size for run in todo}):
            batch = [run for run in todo if run.world_size == world_size]
            per_rank = run_distributed(train_runs, world_size, self.root, batch, torchrun_env=world_size > 1,
                                       timeout=60.0 + 10.0 * world_size * len(batch))
            self.results.update(per_rank[0])  # every rank logs the reduced loss and grad norm

    def result(self, run: Run) -> dict:
        self.train([run])
        result = self.results[run.name]
        if isinstance(result, str):
            raise AssertionError(f"run {dict(run.overrides)} on {run.world_size} process(es) failed:\n{result}")
        return result

    def difference(self, got: Run, want: Run, precision: str) -> Difference:
        """:func:`compare` of two runs (trained if they were not)."""
        self.train([got, want])
        return compare(self.result(got), self.result(want), load_params(self.root, got),
                       load_params(self.root, want), precision)

    def tokens(self, run: Run):
        """[inputs of each of the first STEPS optimizer steps] of ``run``'s training loader (rank 0 of
        one data-parallel rank), built without training."""
        import torch

        from engine.data import build_dataloader
        from engine.data.tokenizer import Tokenizer

        cfg = run_config(self.root, run)
        t = cfg.training
        loader = build_dataloader(cfg.data, Tokenizer(cfg.model.tokenizer_path), seq_len=t.seq_len,
                                  local_batch_size=t.local_batch_size, global_batch_size=t.global_batch_size,
                                  dp_rank=0, dp_degree=1, seed=t.seed)
        return [torch.cat([loader.next_batch()[0] for _ in range(loader.grad_accum_steps)]) for _ in range(STEPS)]
