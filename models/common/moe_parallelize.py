"""The MoE family's part of the shared parallelize driver (parallelisms/parallelize.py).

An MoE model is a LLaMA model whose MoE blocks differ only in the feed-forward. Its
:data:`MOE_PLAN` gives the driver

- a tensor-parallel plan (:func:`moe_tp_plan`): each MoE layer's, then LLaMA's, which shards
  attention, embeddings, output and the dense layers and leaves MoE feed-forwards alone. Each MoE
  layer runs on the whole (all-gathered) sequence and hands back the residual stream's layout (its
  sequence shard under sequence parallel). Shared experts are Megatron column/row parallel like a
  dense feed-forward; the router is replicated on the tp ranks (a Replicate DTensor computing on
  local tensors), and so are the routed experts (the driver's expert step): the tp ranks see the
  same tokens, so they compute the same routing, outputs and gradients, and no reduction over tp is
  needed;
- its experts (:class:`parallelisms.parallelize.ExpertPlan`): the model's MoE layers, whose
  ``experts`` the driver splits over the ep ranks (``ExpertParallel``) and shards with FSDP over the
  ranks left after ep (parallelisms/expert_parallel.py ``shard_experts``), and what the model learns
  that it cannot know on its own: which ranks see different tokens (``token_group``, for the global
  routing counts), the cp group, and how many sequences an optimizer step has (to make the balance
  loss a per-sequence mean independent of the layout).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

from models.common.parallelize import llama_tp_plan
from parallelisms.parallelize import ExpertPlan, ParallelizePlan
from parallelisms.tensor_parallel import ReplicateOnTP, TensorParallelPlan

__all__ = ["MOE_PLAN", "moe_tp_plan", "moe_layer_tp_plan"]


def moe_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
    """The tensor-parallel plan of an ``MoETransformer`` (or pipeline stage): each MoE layer's (see
    the module docstring), then LLaMA's for the rest (models/common/parallelize.py ``llama_tp_plan``).
    """
    pairs = []
    for moe in model.moe_layers():
        pairs += moe_layer_tp_plan(moe, sequence_parallel)
    return pairs + llama_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def moe_layer_tp_plan(moe: nn.Module, sequence_parallel: bool) -> TensorParallelPlan:
    """One MoE layer under tensor parallel, its routed experts aside (see the module docstring)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    pairs = [
        (moe, PrepareModuleInputOutput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True,
        )),
        (moe.router.gate, ReplicateOnTP()),
    ]
    if moe.shared_experts is not None:
        pairs.append((moe.shared_experts, {
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Replicate()),
        }))
    return pairs


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE feed-forwards of the blocks this model or stage holds (``ExpertPlan.layers``)."""
    return model.moe_layers()


def _bind(model: nn.Module, *, token_group, cp_group, sequences_per_step: int) -> None:
    """The model's token group, cp group and sequences per step (``ExpertPlan.bind``)."""
    # The balance loss is a mean over the step's sequences; under context parallel each cp rank
    # adds its share of every sequence's loss (MoE._balance_loss), the same value as one process.
    model.set_aux_loss_scale(sequences_per_step)
    model.token_group = token_group
    for moe in model.moe_layers():
        moe.cp_group = cp_group


MOE_PLAN = ParallelizePlan(tensor_parallel=moe_tp_plan, experts=ExpertPlan(layers=_moe_layers, bind=_bind))
