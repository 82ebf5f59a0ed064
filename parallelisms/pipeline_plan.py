"""Pipeline planning: which layers each stage holds, which stages each rank runs, and the checks.

Pure arithmetic over the config and the layer count, with no torch import, so the launcher's
pre-flight (engine/setup/preflight.py) and the ranks run the same rules. parallelisms/pipeline.py builds
the stages and the torch schedule from a :class:`PipelinePlan`. Schedules and their bubbles: GPipe
(Huang et al. arXiv 1811.06965), 1F1B (Narayanan et al. arXiv 2006.09503), interleaved (arXiv
2104.04473), zero bubble (arXiv 2401.10241).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger("quadra")

KNOWN_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
)
# Schedules that run several stages per rank (torch's PipelineScheduleMulti subclasses).
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules that place two stages per rank in a "V": rank r holds stages r and 2·pp-1-r.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class PipelineConfigError(ValueError):
    """A pipeline setting that cannot work for this model, batch or world size."""


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds and which stages this rank runs.

    Attributes:
        schedule_name: canonical torch schedule name.
        num_stages: K, total stages over all pp ranks.
        stage_layers: for each stage, the layer indices it holds (global indices).
        local_stages: stage indices held by this pp rank, in execution order.
        n_microbatches: M, pipeline microbatches per schedule step.
    """

    schedule_name: str
    num_stages: int
    stage_layers: tuple[tuple[int, ...], ...]
    local_stages: tuple[int, ...]
    n_microbatches: int


def resolve_schedule(name: str) -> tuple[str, bool]:
    """(canonical name, multi-stage?) for a schedule name of torch.distributed.pipelining,
    case-insensitive (tests/integration/test_pipeline.py checks the table against torch's classes).

    Raises:
        PipelineConfigError: unknown name (lists the known ones).
    """
    canonical = next((k for k in KNOWN_SCHEDULES if k.lower() == name.lower()), None)
    if canonical is None:
        raise PipelineConfigError(
            f"parallelism.pp_schedule = {name!r} is not a pipeline schedule; use one of "
            f"{', '.join(KNOWN_SCHEDULES)}."
        )
    return canonical, canonical in MULTI_STAGE_SCHEDULES


def split_layers_evenly(
    n_layers: int, num_stages: int, input_weight: float = 1.0, output_weight: float = 1.0
) -> list[list[int]]:
    """Contiguous layer ranges with about equal cost, counting the embedding as ``input_weight``
    layers (stage 0) and the norm + output head as ``output_weight`` layers (last stage).

    Stage s ends where the running cost crosses s·total/K (rounded to the nearest layer), with at
    least one layer per stage. E.g. 6 layers, 2 stages, weights 1: [[0, 1, 2], [3, 4, 5]].

    Raises:
        PipelineConfigError: more stages than layers.
    """
    if num_stages > n_layers:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages but the model has {n_layers} layers: every stage needs at least "
            "one layer. Lower parallelism.pp or parallelism.pp_stages_per_rank."
        )
    total = n_layers + input_weight + output_weight
    bounds = [0]
    for s in range(1, num_stages):
        cut = math.floor(s * total / num_stages - input_weight + 0.5)
        low = bounds[-1] + 1  # at least one layer in the previous stage
        high = n_layers - (num_stages - s)  # and one left for each later stage
        bounds.append(min(max(cut, low), high))
    bounds.append(n_layers)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def split_layers_at(n_layers: int, split_points: list[str]) -> list[list[int]]:
    """Layer ranges cut before each ``"layers.N"`` in ``split_points`` (strictly increasing).

    Raises:
        PipelineConfigError: a split point that names no layer, is out of order, or leaves a stage empty.
    """
    cuts = []
    for point in split_points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit() or not 0 <= int(index) < n_layers:
            raise PipelineConfigError(
                f"parallelism.pp_split_points entry {point!r} names no module: use 'layers.N' with "
                f"0 < N < {n_layers}."
            )
        cuts.append(int(index))
    bounds = [0, *cuts, n_layers]
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise PipelineConfigError(
                f"parallelism.pp_split_points = {split_points} leaves an empty stage: points must be strictly "
                "increasing, after layers.0."
            )
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stage_ids_for_rank(pp_rank: int, pp_size: int, num_stages: int, v_style: bool) -> tuple[int, ...]:
    """Stages held by ``pp_rank``: loop style (s % pp == rank) or V style (rank, 2·pp-1-rank)."""
    if v_style:
        return (pp_rank, 2 * pp_size - 1 - pp_rank)
    return tuple(range(pp_rank, num_stages, pp_size))


def plan_pipeline(parallelism_cfg, *, n_layers: int, local_batch_size: int, pp_rank: int) -> PipelinePlan:
    """Validate the ``[parallelism]`` pipeline settings and decide the split (no tensors touched).

    Raises:
        PipelineConfigError: unknown schedule; local_batch_size not divisible by pp_microbatch_size;
            fewer microbatches than stages for schedules that need more; stage counts a schedule
            cannot run; more stages than layers; an empty stage; a split point naming no module.
    """
    p = parallelism_cfg
    name, multi = resolve_schedule(p.pp_schedule)
    if p.pp_microbatch_size < 1 or local_batch_size % p.pp_microbatch_size != 0:
        raise PipelineConfigError(
            f"training.local_batch_size = {local_batch_size} is not divisible by parallelism.pp_microbatch_size "
            f"= {p.pp_microbatch_size}; choose a microbatch size that divides the local batch."
        )
    n_microbatches = local_batch_size // p.pp_microbatch_size
    if p.pp_split_points:
        stage_layers = split_layers_at(n_layers, p.pp_split_points)
        num_stages = len(stage_layers)
    elif p.pp_layers_per_stage > 0:
        if n_layers % p.pp_layers_per_stage != 0:
            raise PipelineConfigError(
                f"parallelism.pp_layers_per_stage = {p.pp_layers_per_stage} does not divide the model's "
                f"{n_layers} layers."
            )
        num_stages, stage_layers = n_layers // p.pp_layers_per_stage, None
    else:
        per_rank = p.pp_stages_per_rank if p.pp_stages_per_rank > 0 else (2 if multi else 1)
        num_stages, stage_layers = p.pp * per_rank, None
    if num_stages % p.pp != 0:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages cannot be spread evenly over parallelism.pp = {p.pp} ranks; "
            "make the stage count a multiple of pp."
        )
    per_rank = num_stages // p.pp
    if not multi and per_rank != 1:
        raise PipelineConfigError(
            f"parallelism.pp_schedule = {name!r} runs one stage per rank but the split gives {per_rank}; "
            "use a multi-stage schedule (Interleaved1F1B, LoopedBFS, ...) or one stage per rank."
        )
    if multi and per_rank == 1:
        raise PipelineConfigError(
            f"parallelism.pp_schedule = {name!r} needs several stages per rank but the split gives 1; set "
            "parallelism.pp_stages_per_rank = 2 or use GPipe / 1F1B."
        )
    if name in V_SCHEDULES and per_rank != 2:
        raise PipelineConfigError(f"parallelism.pp_schedule = {name!r} needs exactly 2 stages per rank, "
                                  f"got {per_rank}.")
    if name != "GPipe" and n_microbatches < p.pp:
        # 1F1B-style warm-up needs one microbatch in flight per rank; fewer deadlocks or asserts.
        raise PipelineConfigError(
            f"{n_microbatches} microbatches (training.local_batch_size {local_batch_size} / "
            f"parallelism.pp_microbatch_size {p.pp_microbatch_size}) are fewer than parallelism.pp = {p.pp} "
            f"for schedule {name}; raise local_batch_size or lower pp_microbatch_size."
        )
    if name == "GPipe" and n_microbatches < p.pp:
        # GPipe runs, but most of each step is bubble: (K-1)/(M+K-1) of the time idles.
        logger.warning(
            "%d microbatches for %d pipeline ranks: GPipe idles %.0f%% of each step; raise "
            "training.local_batch_size or lower parallelism.pp_microbatch_size",
            n_microbatches, p.pp, 100 * (num_stages - 1) / (n_microbatches + num_stages - 1),
        )
    if stage_layers is None:
        stage_layers = split_layers_evenly(n_layers, num_stages, p.pp_input_weight, p.pp_output_weight)
    return PipelinePlan(
        schedule_name=name,
        num_stages=num_stages,
        stage_layers=tuple(tuple(layers) for layers in stage_layers),
        local_stages=stage_ids_for_rank(pp_rank, p.pp, num_stages, name in V_SCHEDULES),
        n_microbatches=n_microbatches,
    )


def plan_model_pipeline(parallelism_cfg, model_args, *, local_batch_size: int, pp_rank: int) -> PipelinePlan:
    """Validate the pipeline settings for this model (before any heavy work) and plan the split.

    Raises:
        PipelineConfigError: tied embeddings (the embedding and the output head would live on
            different stages), or any error of :func:`parallelisms.pipeline.plan_pipeline`.
    """
    if model_args.tie_embeddings:
        raise PipelineConfigError(
            "model.tie_embeddings = true cannot be split across pipeline stages (the embedding and the "
            "output head live on different stages); set model.tie_embeddings = false or parallelism.pp = 1."
        )
    return plan_pipeline(
        parallelism_cfg, n_layers=model_args.n_layers, local_batch_size=local_batch_size, pp_rank=pp_rank
    )
