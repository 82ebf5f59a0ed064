"""Pipeline parallel: split the model's layers into stages over the ``pp`` sub-mesh and run a schedule.

Consecutive layers go to consecutive stages; each optimizer step's local batch is cut into
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

import contextlib
import copy
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineSchedule,
    get_schedule_class,
)

from parallelisms.pipeline_plan import (  # noqa: F401  (re-exported: the planning half of pipeline parallel)
    KNOWN_SCHEDULES,
    MULTI_STAGE_SCHEDULES,
    V_SCHEDULES,
    PipelineConfigError,
    PipelinePlan,
    plan_pipeline,
    resolve_schedule,
    split_layers_at,
    split_layers_evenly,
    stage_ids_for_rank,
)


def build_stage_module(model: nn.Module, layer_ids: tuple[int, ...], is_first: bool, is_last: bool) -> nn.Module:
    """A copy of (meta) ``model`` that keeps only ``layer_ids`` and the ends this stage owns.

    The modules a family names in ``head_modules`` (beside the output head, e.g. multi-token
    prediction) stay on the last stage only. When they read the token embedding
    (``head_reads_embeddings``), a last stage after the first keeps ``tok_embeddings`` too, as a
    copy under the same name (so checkpoints hold one tensor, whatever the split) that does not embed
    the stage's input (``embeds_tokens = False``); :func:`parallelisms.pipeline_tied.sum_tied_gradients`
    keeps the two copies equal."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    head_reads = is_last and getattr(stage, "head_reads_embeddings", False)
    # The first and the last stage share the embedding when they are different stages.
    stage.shares_embeddings = getattr(stage, "head_reads_embeddings", False) and is_first != is_last
    if not is_first:
        stage.embeds_tokens = False
        if not head_reads:
            stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
        for name in getattr(stage, "head_modules", ()):
            setattr(stage, name, None)
    return stage


_shape_inference_depth = 0


def in_shape_inference() -> bool:
    """True while a stage runs torch's shape-inference forward (not a training microbatch): module
    hooks that observe training (engine/observe/record.py) skip it."""
    return _shape_inference_depth > 0


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
        global _shape_inference_depth
        _shape_inference_depth += 1
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            _shape_inference_depth -= 1

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        with torch.no_grad():
            for buffer, saved in self._buffer_snapshot or []:
                buffer.copy_(saved)
        self._buffer_snapshot = None


def forward_only_actions(num_stages: int, n_microbatches: int,
                         stage_ranks: dict[int, tuple[int, ...]]) -> dict[int, list[_Action]]:
    """An evaluation order for any stage placement, lowered with torch's own passes (the FSDP
    unshard/reshard and the sends and receives): every rank runs the forwards of its stages, the
    lowest stage first, all microbatches of one stage before the next (the forward half of Looped
    BFS, Lamy-Poirier arXiv 2211.05953). It cannot deadlock: stage s waits only for stage s - 1,
    which its rank ran earlier or another rank runs without waiting on stage s.

    Args:
        num_stages: K; n_microbatches: M; stage_ranks: for every pp rank, the stages it holds.

    Returns:
        {pp rank: actions}, the form of ``_PipelineScheduleRuntime.pipeline_order_with_comms``.
    """
    rank_of = {stage: rank for rank, ids in stage_ranks.items() for stage in ids}
    compute = {
        rank: _add_unshard_reshard([_Action(stage, _ComputationType.FORWARD, mb)
                                    for stage in sorted(ids) for mb in range(n_microbatches)])
        for rank, ids in stage_ranks.items()
    }
    return _add_send_recv(compute, stage_to_rank=rank_of.__getitem__, num_stages=num_stages)


@contextlib.contextmanager
def evaluation_order(schedule: _PipelineSchedule, plan: PipelinePlan, pp_size: int):
    """Around ``schedule.eval()``: the V-shaped schedules (ZBVZeroBubble, DualPipeV) run
    :func:`forward_only_actions` instead of their own actions, whose split backward torch's
    ``eval()`` keeps and fails on ("can't steal_bwd_input if this stage doesn't have backward",
    torch 2.13). The same schedule object runs both, so that torch's eval/train switch of its
    stages stays its own. Other schedules evaluate with their own actions."""
    if plan.schedule_name not in V_SCHEDULES:
        yield
        return
    stage_ranks = {rank: stage_ids_for_rank(rank, pp_size, plan.num_stages, v_style=True) for rank in range(pp_size)}
    training = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = forward_only_actions(plan.num_stages, plan.n_microbatches, stage_ranks)
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = training


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
    _, multi = resolve_schedule(plan.schedule_name)
    cls = get_schedule_class(plan.schedule_name)
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

