"""Pipeline parallel: split the model's layers into stages over the ``pp`` sub-mesh and run a schedule.

SEED.md §7. Consecutive layers go to consecutive stages; each optimizer step's local batch is cut into
M microbatches so stages work concurrently. GPipe runs all forwards then all backwards (bubble
(K-1)/(M+K-1) for K stages, Huang et al. arXiv 1811.06965); 1F1B alternates one forward and one
backward after a warm-up, bounding live activations (PipeDream-Flush, Narayanan et al. arXiv
2006.09503); interleaved schedules put several smaller stages on each rank to shrink the bubble
(Megatron-LM, arXiv 2104.04473); zero-bubble schedules split backward into input and weight
gradients (arXiv 2401.10241). All schedules are torch.distributed.pipelining's.

The model is split on the meta device: each stage is a copy of the whole model with the layers of
other stages deleted and ``tok_embeddings`` / ``norm`` / ``output`` set to None where absent. Layer
keys stay global ("layers.7"), so weights initialize and checkpoint the same as without PP.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _PipelineSchedule,
    get_schedule_class,
)

logger = logging.getLogger("quadra")

KNOWN_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
)
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


def resolve_schedule(name: str) -> tuple[str, type[_PipelineSchedule], bool]:
    """(canonical name, schedule class, multi-stage?) for a schedule name, case-insensitive.

    Raises:
        PipelineConfigError: unknown name (lists the known ones).
    """
    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise PipelineConfigError(
            f"parallelism.pp_schedule = {name!r} is not a pipeline schedule; use one of "
            f"{', '.join(KNOWN_SCHEDULES)}."
        ) from None
    canonical = next((k for k in KNOWN_SCHEDULES if k.lower() == name.lower()), name)
    if canonical not in KNOWN_SCHEDULES:  # the abstract base classes are in torch's map too
        raise PipelineConfigError(
            f"parallelism.pp_schedule = {name!r} is a base class; use one of {', '.join(KNOWN_SCHEDULES)}."
        )
    return canonical, cls, issubclass(cls, PipelineScheduleMulti)


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
    name, _, multi = resolve_schedule(p.pp_schedule)
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
        raise PipelineConfigError(f"parallelism.pp_schedule = {name!r} needs exactly 2 stages per rank, got {per_rank}.")
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


def build_stage_module(model: nn.Module, layer_ids: tuple[int, ...], is_first: bool, is_last: bool) -> nn.Module:
    """A copy of (meta) ``model`` that keeps only ``layer_ids`` and the ends this stage owns."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage


class _InferenceFreeStage(PipelineStage):
    """A ``PipelineStage`` whose shape-inference passes leave the module's buffers as they were.

    To learn tensor shapes, torch runs one real forward (and backward) of every stage at the first
    step and after each eval/train switch; later stages get uninitialized inputs. Buffers updated
    by the forward (e.g. the MoE routing counts that set load-balancing biases) must not see those
    passes, so they are snapshotted before and restored after.
    """

    _buffer_snapshot: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _prepare_forward_infra(self, *args, **kwargs):
        if self._buffer_snapshot is None:
            self._buffer_snapshot = [(b, b.detach().clone()) for b in self.submod.buffers()]
        return super()._prepare_forward_infra(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        with torch.no_grad():
            for buffer, saved in self._buffer_snapshot or []:
                buffer.copy_(saved)
        self._buffer_snapshot = None


def build_pipeline_schedule(
    plan: PipelinePlan,
    stage_modules: list[nn.Module],
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable,
) -> tuple[_PipelineSchedule, list[PipelineStage]]:
    """Wrap this rank's (parallelized, materialized) stage modules and build the schedule.

    ``scale_grads=False``: the loss is already divided by the global token count of the step, so
    the schedule must not divide gradients by the number of microbatches again.
    """
    _, cls, multi = resolve_schedule(plan.schedule_name)
    group = pp_mesh.get_group()
    stages = [
        _InferenceFreeStage(module, stage_index, plan.num_stages, device, group=group)
        for module, stage_index in zip(stage_modules, plan.local_stages)
    ]
    if multi:
        schedule = cls(stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule, stages
