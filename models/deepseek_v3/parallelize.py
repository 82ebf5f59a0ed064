"""DeepSeek-V3's part of the shared parallelize driver (parallelisms/parallelize.py).

:data:`DEEPSEEK_V3_PLAN` gives the driver the MoE family's experts (models/common/moe_parallelize.py:
routed experts over ep, their FSDP units, the token / cp groups) and this tensor-parallel plan:

- outside the blocks, the dense feed-forwards, the norms and each MoE layer: as LLaMA's and the MoE
  family's (``outer_tp_plan``, ``block_tp_plan``, ``moe_layer_tp_plan``);
- MLA (Megatron-LM's head split, arXiv 1909.08053 §3, applied to DeepSeek-V2's latent attention):
  the per-head projections wq / wq_b and wkv_b column-parallel (each rank owns n_heads / tp heads),
  wo row-parallel. The latents are shared by all heads, so wq_a, wkv_a and their RMSNorms q_norm,
  kv_norm are replicated (Replicate DTensors computing on local tensors, :class:`ReplicateOnTP`) on
  the whole (all-gathered) sequence. Their gradients must be the sum over every head: the
  column-parallel wq_b / wkv_b sum the partial input gradients of their heads over tp (Megatron's
  "f" operator, in DTensor's backward), and the RoPE key, which bypasses wkv_b and reaches every
  head, is summed by :class:`SumGradientOnTP` on ``attention.rope_key``'s input. So every tp rank
  gets the full gradient of the replicated latent weights and norms.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.common.parallelize import block_tp_plan, outer_tp_plan
from models.common.moe_parallelize import MOE_PLAN, moe_layer_tp_plan
from parallelisms.parallelize import ParallelizePlan
from parallelisms.tensor_parallel import ReplicateOnTP, TensorParallelPlan

__all__ = ["DEEPSEEK_V3_PLAN", "deepseek_v3_tp_plan", "SumGradientOnTP"]


class SumGradientOnTP(ParallelStyle):
    """The module's first input passes unchanged forward; its gradient is all-reduced (summed) over
    tp in backward (Megatron's "f" operator): for a tensor every tp rank holds whole whose
    consumers are split over the ranks' heads (``DTensor.to_local(grad_placements=[Partial()])``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_gradient(_, inputs, mesh):
            first = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return (first.to_local(grad_placements=[Partial()]), *inputs[1:])

        return distribute_module(module, device_mesh, input_fn=sum_gradient)


def _attention_plan(attention: nn.Module, sequence_parallel: bool) -> dict:
    """MLA under tensor parallel (module docstring); names relative to the block."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # One all-gather (SP) of the block's input; the attention then sees plain local tensors.
        "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=True),
        "attention.wkv_a": ReplicateOnTP(),
        "attention.kv_norm": ReplicateOnTP(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.rope_key": SumGradientOnTP(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
    }
    if attention.q_lora_rank:
        plan.update({"attention.wq_a": ReplicateOnTP(), "attention.q_norm": ReplicateOnTP(),
                     "attention.wq_b": ColwiseParallel()})
    else:
        plan["attention.wq"] = ColwiseParallel()
    return plan


def deepseek_v3_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
    """The tensor-parallel plan of a ``DeepseekV3Transformer`` (or pipeline stage); see the module docstring.

    Returns:
        (module, style or {sub-module name: style}) pairs: each MoE layer's, the model's embedding,
        final norm and output, then each block's.
    """
    pairs = []
    for moe in model.moe_layers():
        pairs += moe_layer_tp_plan(moe, sequence_parallel)
    # The latent norms are Replicate DTensors, so every other norm is a DTensor too (one kind of
    # tensor per optimizer group): qk_norm=True gives LLaMA's norms that placement without SP.
    pairs.append((model, outer_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                       replicate_norm=True)))
    mtp = list(model.mtp.values()) if getattr(model, "mtp", None) is not None else []
    for block in [*model.layers.values(), *(module.block for module in mtp)]:
        plan = {name: style for name, style in block_tp_plan(sequence_parallel, qk_norm=True).items()
                if not name.startswith("attention.") and name != "attention"}
        if block.is_moe:
            plan = {name: style for name, style in plan.items() if not name.startswith("feed_forward")}
        pairs.append((block, {**plan, **_attention_plan(block.attention, sequence_parallel)}))
    for module in mtp:
        pairs += _mtp_plan(module, sequence_parallel)
    return pairs


def _mtp_plan(module: nn.Module, sequence_parallel: bool) -> TensorParallelPlan:
    """One multi-token-prediction depth (models/deepseek_v3/mtp.py) beside its block's plan: its two
    inputs (previous hidden state, embedding of token t+k; sequence shards under SP) are gathered
    whole, ``enorm``, ``hnorm`` and ``eh_proj`` run replicated on them (equal gradients on every tp
    rank, as the latents'), and ``eh_proj``'s output is cut back to this rank's sequence shard for
    the block; ``norm`` (before the shared head) is the final norm's style."""
    stream = Shard(1) if sequence_parallel else Replicate()
    pairs = [(module, PrepareModuleInput(input_layouts=(stream, stream, None, None, None),
                                         desired_input_layouts=(Replicate(), Replicate(), None, None, None),
                                         use_local_output=True)),
             (module, {"enorm": ReplicateOnTP(), "hnorm": ReplicateOnTP(), "eh_proj": ReplicateOnTP(),
                       "norm": SequenceParallel() if sequence_parallel else ReplicateOnTP()})]
    if sequence_parallel:
        pairs.append((module.eh_proj, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=stream,
                                                          use_local_output=True)))
    return pairs


DEEPSEEK_V3_PLAN = ParallelizePlan(tensor_parallel=deepseek_v3_tp_plan, experts=MOE_PLAN.experts)
