"""Shared helpers for tests that train: a small fixed setting and loss/grad-norm comparison."""

from __future__ import annotations

import contextlib
import logging
import math
import os

from engine.parity import compare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The 0.2 MB validation split is the training data of the tests: fast to tokenize, real text.
SMALL_CORPUS = os.path.join(REPO, "assets", "data", "shakespeare", "validation.jsonl")
PARITY_STEPS = 5
# The suite's LLaMA flavor (models/llama/flavors.py): debugmodel's layout at a quarter of its width,
# so a step of a multi-process layout costs a third of debugmodel's; MoE runs the same-named flavor
# of models/moe/flavors.py unless a test names another.
FLAVOR = "debugmodel_tiny"
MOE_FLAVOR = "debugmodel_tiny"
# Clipping on both sides of the threshold: at this learning rate the grad norm of the 5-step run
# rises from 0.54 (steps 1-3, under MAX_NORM: no clipping) to 0.77-0.79 (steps 4-5, clipped by
# 0.83). A clip that also scaled gradients *up* below the threshold (by 1.2 at step 1) moves the
# loss of step 2 by 4e-4, over the 1e-4 parity tolerance; one that never clips moves step 5's.
# conftest.py's `reference` checks that both sides are present with a 10 % margin.
MAX_NORM = 0.65
CLIP_MARGIN = compare.CLIP_MARGIN
# Adam's eps and the learning rate decide how much a wrong clipping factor moves the weights: with
# eps near the gradients' RMS (~7e-4 here) the update follows the gradients' scale; with eps 1e-8
# Adam would cancel any constant factor.
EPS, LR = 1e-4, 3e-2
# Validation in every run, as in the default config (mid-run after steps 2 and 4, and at the end):
# one batch per dp rank of the small corpus, compared with one process's like the training loss.
VALIDATION_FREQ = 2
# 32 tokens: divisible by 2·cp·tp = 8 of every cp layout; a step costs half of 64's.
SEQ_LEN = 32
# torch.compile as the compiled parity layouts run it: Dynamo and AOTAutograd trace the blocks (forward
# and backward graphs, the ring's custom operator as an opaque node) as they would for inductor,
# without inductor's C++ code generation (20-40 s per rank on a CPU; tests/integration/test_ac_compile.py
# lowers the dense model with inductor).
COMPILED = {"compile.enable": "true", "compile.backend": "aot_eager"}


def base_args(dump_folder: str, overrides: dict | None = None) -> list[str]:
    """CLI arguments of a 5-step fp32 run of the tests' flavor (:data:`FLAVOR`, :data:`MOE_FLAVOR`
    for ``model.name = "moe"``, unless ``overrides`` names one) on the small corpus (global batch 8 × 32 tokens), on the CPU, with gradient clipping
    engaged on some steps and not on others (see MAX_NORM)."""
    settings = {
        "model.flavor": FLAVOR,
        "job.dump_folder": dump_folder,
        "job.print_config": "false",
        # CPU even where CUDA exists: these tests compare gloo layouts with one CPU process.
        "job.device": "cpu",
        # Between the grad norms of steps 1-3 and of steps 4-5 (see MAX_NORM): a wrong norm
        # reduction over any mesh changes the logged norm, a wrong clip the next step's loss.
        "training.max_norm": str(MAX_NORM),
        # Adam divides each update by sqrt(v) + eps, which cancels any constant scale of the
        # gradients when eps is tiny: a wrong clipping factor would then leave the weights almost
        # unchanged. An eps near the gradients' RMS (~7e-4 here) makes the update follow the scale.
        "optimizer.eps": str(EPS),
        "optimizer.lr": str(LR),
        "data.path": SMALL_CORPUS,
        "training.steps": str(PARITY_STEPS),
        "training.seq_len": str(SEQ_LEN),
        "training.local_batch_size": "8",
        "training.global_batch_size": "8",
        "training.gc_freq": "0",
        "lr_scheduler.warmup_steps": "2",
        "metrics.log_freq": "1",
        "metrics.enable_tensorboard": "false",
        # On, as users run it (the default config validates): every layout's evaluation is checked.
        "validation.enable": "true",
        "validation.path": SMALL_CORPUS,
        "validation.freq": str(VALIDATION_FREQ),
        "validation.steps": "1",
        # Off unless a test is about them: each costs start-up or per-step time in every run.
        "metrics.time_attribution": "false",
        "comm.init_timeout_seconds": "60",
        # The fused loss (the default) in chunks of 48 tokens: every layout's tokens per microbatch
        # and rank (8 to 256) then span one partial or several chunks, the last one partial.
        "loss.chunk_tokens": "48",
    }
    if (overrides or {}).get("model.name", "llama") == "moe":
        settings["model.flavor"] = MOE_FLAVOR
    settings.update({key: str(value) for key, value in (overrides or {}).items()})
    argv: list[str] = []
    for key, value in settings.items():
        argv += [f"--{key}", value]
    return argv


def train_to_end(argv: list[str]) -> None:
    """Build a Trainer from ``argv`` and train to ``training.steps`` (in a test's forked ranks)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    try:
        trainer.train()
    finally:
        trainer.close()


def gradient_placement_errors(params) -> list[str]:
    """Parameters whose gradient is not laid out like the parameter: a DTensor gradient must have the
    parameter's mesh, placements and local shape (else it is e.g. a full-size replica of a sharded
    weight), a plain gradient the parameter's shape."""
    from torch.distributed.tensor import DTensor

    errors = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(param, DTensor):
            if not isinstance(grad, DTensor):
                errors.append(f"{tuple(param.shape)}: plain gradient for a DTensor {param.placements}")
            elif (grad.device_mesh, grad.placements, grad.to_local().shape) != (
                param.device_mesh, param.placements, param.to_local().shape
            ):
                errors.append(f"{tuple(param.shape)}: gradient {grad.placements} local {tuple(grad.to_local().shape)}"
                              f" vs parameter {param.placements} local {tuple(param.to_local().shape)}")
        elif isinstance(grad, DTensor) or grad.shape != param.shape:
            errors.append(f"{tuple(param.shape)}: gradient {type(grad).__name__} {tuple(grad.shape)}")
    return errors


class History(list):
    """[(loss, grad_norm)] per step, as every rank logged them, with what else the run reported:
    ``validation`` [(step, validation loss)] and ``model_metrics`` [{name: value}] per step (e.g.
    the MoE routing counts; empty dicts for LLaMA)."""

    def __init__(self, steps=(), validation=(), model_metrics=()):
        super().__init__(steps)
        self.validation = list(validation)
        self.model_metrics = list(model_metrics)


def train_and_record(argv: list[str]) -> History:
    """Build a Trainer from CLI-style arguments, train, return the :class:`History` of every step.

    Before every optimizer step, every gradient must be laid out like its parameter
    (:func:`gradient_placement_errors`): so each parity layout also checks that no rank holds more
    gradient than its shard of the parameter. Every validation the loop runs is recorded.
    """
    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)

    def check_placements(optimizer, *_):
        errors = gradient_placement_errors([p for group in optimizer.param_groups for p in group["params"]])
        assert not errors, "gradients not laid out like their parameters: " + "; ".join(errors)

    trainer.optimizer.register_step_pre_hook(check_placements)
    validation, validate = [], trainer.validate

    def record_validation():
        loss = validate()
        validation.append((trainer.step, loss))
        return loss

    trainer.validate = record_validation
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return History([(h["loss"], h["grad_norm"]) for h in history], validation,
                   [h["model_metrics"] for h in history])


def assert_parity(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> None:
    """Loss and grad norm: relative 1e-5 at step 1, 1e-4 at every step (fp32 standard). Where both
    are :class:`History` records, also the validation losses (1e-5, as the issue of the validation
    defect asks; the runs must have validated at the same steps) and the model metrics (as the loss
    of the same step)."""
    assert len(got) == len(want) == PARITY_STEPS, (len(got), len(want))
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), start=1):
        tol = compare.tolerance(step)  # engine/parity/compare.py, shared with ./scripts/parity.py
        assert math.isclose(loss, ref_loss, rel_tol=tol), f"step {step}: loss {loss} vs {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=tol), f"step {step}: grad_norm {norm} vs {ref_norm}"
    if not (isinstance(got, History) and isinstance(want, History)):
        return
    assert [s for s, _ in got.validation] == [s for s, _ in want.validation], (got.validation, want.validation)
    for (step, loss), (_, ref_loss) in zip(got.validation, want.validation):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"validation after step {step}: {loss} vs {ref_loss}"
    for step, (metrics, ref_metrics) in enumerate(zip(got.model_metrics, want.model_metrics), start=1):
        assert metrics.keys() == ref_metrics.keys(), (step, metrics, ref_metrics)
        tol = compare.tolerance(step)
        for name, value in metrics.items():
            assert math.isclose(value, ref_metrics[name], rel_tol=tol, abs_tol=1e-9), \
                f"step {step}: {name} {value} vs {ref_metrics[name]}"


def clipping_sides(history: list[tuple[float, float]], max_norm: float = MAX_NORM) -> tuple[int, int]:
    """(steps clipped, steps not clipped) of a history, counting only norms at least
    :data:`CLIP_MARGIN` away from ``max_norm`` (a step near it tells a wrong clip little)."""
    return compare.clipping_sides(history, max_norm)


def run_in_turn(layouts: dict[str, dict], run_one) -> dict[str, object]:
    """Inside every rank of one process group: ``run_one(name, overrides)`` for each layout in turn,
    {name: its result}. After a failure the remaining layouts are not run (the ranks may no longer
    agree); the failed layout maps to its traceback, the others to "not run"."""
    import traceback

    results: dict[str, object] = {}
    failed = None
    for name, overrides in layouts.items():
        if failed is not None:
            results[name] = f"not run: layout {failed} failed before it in the same ranks"
            continue
        try:
            results[name] = run_one(name, overrides)
        except Exception:  # noqa: BLE001 - reported by that layout's test
            results[name] = traceback.format_exc()
            failed = name
    return results


@contextlib.contextmanager
def quadra_log_lines(*words: str):
    """Within the block, collect the "quadra" logger's records whose message contains any of ``words``
    as (level name, message) in the list it yields; the logger passes INFO lines meanwhile."""
    lines: list[tuple[str, str]] = []

    class Catch(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if any(word in message for word in words):
                lines.append((record.levelname, message))

    logger, handler = logging.getLogger("quadra"), Catch()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def with_compiled_twins(layouts: dict[str, tuple], also: tuple[str, ...] = ()) -> dict[str, tuple]:
    """``layouts`` ({name: (world_size, overrides, ...)}) and, after them, a ``<name>_compiled`` twin
    of every layout with context parallel (cp > 1) and of those named in ``also``: the same tuple
    with :data:`COMPILED` added to its overrides, so each compiled layout trains in the same forked
    ranks as its eager one and is compared with the same one-process reference."""
    twins = {f"{name}_compiled": (layout[0], {**layout[1], **COMPILED}, *layout[2:])
             for name, layout in layouts.items() if int(layout[1].get("parallelism.cp", 1)) > 1 or name in also}
    return {**layouts, **twins}


def train_layouts(folder: str, layouts: dict[str, dict]) -> dict[str, list | str]:
    """:func:`run_in_turn` of :func:`train_and_record` (a fresh Trainer and mesh per layout):
    {name: history, or the failure's traceback}. Dynamo's caches are cleared before each compiled
    layout: every layout builds new modules whose recompiles of the shared code objects (the blocks'
    forward) would otherwise add up to Dynamo's recompile limit, which ``fullgraph`` turns into an
    error; a training process builds one model."""

    def one(name: str, overrides: dict):
        if str(overrides.get("compile.enable", "false")).lower() == "true":
            import torch

            torch._dynamo.reset()
        return train_and_record(base_args(f"{folder}/{name}", overrides))

    return run_in_turn(layouts, one)


class LayoutRuns:
    """Parity layouts of one test module, trained lazily and once per world size: all layouts of a
    world size run in the same forked ranks (one process group), which saves a fork, a process-group
    set-up and the imports per layout. ``history(name)`` returns every rank's [(loss, grad_norm)].

    Args:
        layouts: {name: (world_size, overrides)}; folder: a temporary folder for the run folders.
    """

    def __init__(self, layouts: dict[str, tuple[int, dict]], folder: str):
        self.layouts = layouts
        self.folder = folder
        self._cache: dict[int, list[dict]] = {}

    def history(self, name: str) -> list[list[tuple[float, float]]]:
        from engine.testing.processes import run_distributed

        world_size, _ = self.layouts[name]
        if world_size not in self._cache:
            same = {n: overrides for n, (w, overrides) in self.layouts.items() if w == world_size}
            timeout = 60.0 + 60.0 * world_size * len(same)
            self._cache[world_size] = run_distributed(
                train_layouts, world_size, f"{self.folder}/world{world_size}", same, timeout=timeout,
                torchrun_env=world_size > 1,
            )
        per_rank = [results[name] for results in self._cache[world_size]]
        for result in per_rank:
            if isinstance(result, str):
                raise AssertionError(f"layout {name}:\n{result}")
        return per_rank
