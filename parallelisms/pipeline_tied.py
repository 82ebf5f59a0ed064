"""A weight two pipeline stages share: the token embedding of the first stage and its copy on the last.

DeepSeek-V3's multi-token prediction (arXiv 2412.19437 §2.2) reads the embedding of tokens t+k on
the last stage, beside the output head; with pipeline parallel the embedding lives on the first.
As Megatron-LM does for tied input/output embeddings (Shoeybi et al. 2019, arXiv 1909.08053; its
``embedding group`` of the first and last pipeline ranks), the last stage holds a copy, initialized
from the same seed, and after each step's backward both copies receive the sum of the two stages'
gradients. Equal values, equal gradients and the same optimizer then keep them equal, and the step is
the one-process step of the shared weight.

The copy on the last stage is marked ``embeds_tokens = False`` by ``build_stage_module``
(parallelisms/pipeline.py); both ends are marked ``shares_embeddings``. The gradient norm counts
the copy's gradient once (:func:`tied_copies` lists the copies to leave out of it; they are still
clipped with the rest).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallelisms.pipeline_plan import V_SCHEDULES, PipelinePlan, stage_ids_for_rank

__all__ = ["tied_copies", "sum_tied_gradients"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _ends(model_parts: list[nn.Module]) -> list[nn.Module]:
    return [part for part in model_parts if getattr(part, "shares_embeddings", False)]


def tied_copies(model_parts: list[nn.Module]) -> list[torch.Tensor]:
    """The embedding copies held beside a last stage's head (``embeds_tokens`` False): parameters
    whose gradient another stage's original already counts in the gradient norm."""
    return [part.tok_embeddings.weight for part in _ends(model_parts) if not part.embeds_tokens]


def _owner(stage: int, plan: PipelinePlan, pp_size: int) -> int:
    v_style = plan.schedule_name in V_SCHEDULES
    return next(r for r in range(pp_size) if stage in stage_ids_for_rank(r, pp_size, plan.num_stages, v_style))


@torch.no_grad()
def sum_tied_gradients(model_parts: list[nn.Module], plan: PipelinePlan, pp_group: dist.ProcessGroup) -> None:
    """Give the first stage's embedding and the last stage's copy the sum of their gradients, in place.

    Call after the step's last backward (gradients reduced over data parallel) and before clipping.
    The two ends exchange their local shards point to point (the same dp / tp coordinates hold the
    same shard layout on both), or add them here when this rank holds both; a rank with neither end
    does nothing. IEEE addition is commutative, so both ends hold the same bits.

    Raises:
        RuntimeError: a tied end without a gradient (its stage did not run backward).
    """
    ends = _ends(model_parts)
    if not ends:
        return
    grads = [part.tok_embeddings.weight.grad for part in ends]
    if any(grad is None for grad in grads):
        raise RuntimeError("a pipeline stage sharing the token embedding has no gradient for it after backward")
    local = [_local(grad) for grad in grads]
    if len(local) == 2:
        total = local[0] + local[1]
        for tensor in local:
            tensor.copy_(total)
        return
    pp_size = dist.get_world_size(pp_group)
    other = plan.num_stages - 1 if ends[0].embeds_tokens else 0
    peer = dist.get_global_rank(pp_group, _owner(other, plan, pp_size))
    mine, theirs = local[0].contiguous(), torch.empty_like(local[0])
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group=pp_group),
                                           dist.P2POp(dist.irecv, theirs, peer, group=pp_group)]):
        request.wait()
    local[0].add_(theirs)
