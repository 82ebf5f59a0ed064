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
  needed. When the routed experts are split over tp as well (ep spanning tp, ``ParallelDims.ep_over_tp``,
  TorchTitan 0.3's layout), the layer instead runs on its sequence shard [B, S/tp, dim]: under sequence
  parallel that is its input as it comes; without it each tp rank takes the slice [r·S/tp, (r+1)·S/tp)
  of the replicated sequence (the shard sequence parallel would give it, so one code path; disjoint, so
  no tp rank dispatches another's tokens; whole-sequence slices, so the balance loss sums over the
  cp × tp ranks as it does over cp). Each tp rank routes and dispatches only its tokens; the router's
  gradient is summed over tp (``SumWeightGradientOnTP``); the shared experts all-gather the shard, run
  column/row parallel and reduce-scatter back onto it; the output is all-gathered again without SP;
- its experts (:class:`parallelisms.parallelize.ExpertPlan`): the model's MoE layers, whose
  ``experts`` the driver splits over the ep ranks (``ExpertParallel``) and shards with FSDP over the
  ranks left after ep (parallelisms/expert_parallel.py ``shard_experts``), and what the model learns
  that it cannot know on its own: which ranks see different tokens (``token_group``, for the global
  routing counts), the cp group, and how many sequences an optimizer step has (to make the balance
  loss a per-sequence mean independent of the layout).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel)

from models.common.parallelize import llama_tp_plan
from parallelisms.parallelize import ExpertPlan, ParallelizePlan
from parallelisms.tensor_parallel import ReplicateOnTP, TensorParallelPlan

__all__ = ["MOE_PLAN", "SumWeightGradientOnTP", "moe_tp_plan", "moe_layer_tp_plan"]


def moe_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
    """The tensor-parallel plan of an ``MoETransformer`` (or pipeline stage): each MoE layer's (see
    the module docstring), then LLaMA's for the rest (models/common/parallelize.py ``llama_tp_plan``).
    """
    pairs = []
    for moe in model.moe_layers():
        pairs += moe_layer_tp_plan(moe, sequence_parallel)
    return pairs + llama_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


class SumWeightGradientOnTP(ParallelStyle):
    """Replicate DTensor weights that compute on local tensors whose inputs differ per tp rank (the
    router of a layer whose tokens are split over tp): the weight enters the forward as
    ``to_local(grad_placements=[Partial()])``, so its gradient is summed over tp in backward. For a
    bias-free ``nn.Linear``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)

        def forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            # mod.weight is read at call time: FSDP swaps in its unsharded DTensor before forward.
            return F.linear(x, mod.weight.to_local(grad_placements=[Partial()]))

        module.forward = types.MethodType(forward, module)
        return module


def moe_layer_tp_plan(moe: nn.Module, sequence_parallel: bool) -> TensorParallelPlan:
    """One MoE layer under tensor parallel, its routed experts aside (see the module docstring)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    if getattr(moe, "routed_tp_group", None) is not None:
        return _split_over_tp_plan(moe, stream)
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


def _split_over_tp_plan(moe: nn.Module, stream) -> TensorParallelPlan:
    """One MoE layer whose routed experts span tp: it runs on its sequence shard (module docstring)."""
    pairs = [
        (moe, PrepareModuleInputOutput(
            input_layouts=(stream,), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(stream,), use_local_output=True,
        )),
        (moe.router.gate, SumWeightGradientOnTP()),
    ]
    if moe.shared_experts is not None:
        # One all-gather of the shard for w1 and w3 (a DTensor input: its Partial gradient is
        # reduce-scattered back), one reduce-scatter after w2.
        pairs.append((moe.shared_experts, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False)))
        pairs.append((moe.shared_experts, {
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Shard(1)),
        }))
    return pairs


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE feed-forwards of the blocks this model or stage holds (``ExpertPlan.layers``)."""
    return model.moe_layers()


def _bind(model: nn.Module, *, token_group, cp_group, tp_group=None, sequences_per_step: int) -> None:
    """The model's token group, sequence (cp or cp × tp) group, tp group when the routed experts span
    tp, and sequences per step (``ExpertPlan.bind``)."""
    # The balance loss is a mean over the step's sequences; under context parallel each cp rank
    # adds its share of every sequence's loss (MoE._balance_loss), the same value as one process.
    model.set_aux_loss_scale(sequences_per_step)
    model.token_group = token_group
    model.routed_tp_group = tp_group
    for moe in model.moe_layers():
        moe.cp_group = cp_group
        moe.routed_tp_group = tp_group


MOE_PLAN = ParallelizePlan(tensor_parallel=moe_tp_plan, experts=ExpertPlan(layers=_moe_layers, bind=_bind))
