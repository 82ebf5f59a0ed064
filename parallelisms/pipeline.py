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

import copy
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class

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
