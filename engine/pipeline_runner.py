"""This rank's side of pipeline parallel in the trainer: the schedule step, evaluation through the
schedule, the stage-sum of the loss, and the measured bubble.

Only the rank holding the last stage sees the loss; it is summed over the pp group (other ranks
contribute 0) so that every rank logs the true loss, never a placeholder (DESIGN.md rule 7).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from engine.loss import token_sum_loss
from parallelisms.pipeline import PipelinePlan, build_pipeline_schedule
from parallelisms.pipeline_plan import plan_model_pipeline  # noqa: F401  (re-exported)
from parallelisms.pipeline_timing import StageBusyTimer


class PipelineRunner:
    """Drives this rank's stages of ``plan`` with the planned torch schedule.

    Args:
        plan: the split; parts: this rank's parallelized, materialized stage modules (plan order);
        pp_mesh: the pp sub-mesh; device: this rank's device.
    """

    def __init__(self, plan: PipelinePlan, parts: list[nn.Module], pp_mesh: DeviceMesh, device: torch.device):
        self.schedule, stages = build_pipeline_schedule(plan, parts, pp_mesh, device, token_sum_loss)
        self.has_first = 0 in plan.local_stages
        self.has_last = plan.num_stages - 1 in plan.local_stages
        self.group = pp_mesh.get_group()
        self.device = device
        self.timer = StageBusyTimer(stages, device)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor) -> torch.Tensor:
        """One schedule step over a [local_batch_size, S] batch cut into the plan's microbatches.

        Returns:
            The batch's loss contribution (token sum / global_tokens) on the last stage, 0 elsewhere.
        """
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (inputs,) if self.has_first else ()
        self.schedule.step(
            *args,
            target=labels if self.has_last else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs={"global_tokens": global_tokens},
        )
        if losses:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), device=self.device)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only (``schedule.eval``): the batch's token-sum loss on the last stage, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for loss in losses:
            total += loss.double()
        return total

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM over the pp group, in place (the last stage's value reaches every rank)."""
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value
