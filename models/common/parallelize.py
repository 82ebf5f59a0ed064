"""LLaMA's part of the shared parallelize driver (parallelisms/parallelize.py): its tensor-parallel plan.

The driver applies every step in the one order (TP → EP → CP → activation checkpointing → compile →
FSDP/HSDP or DDP); this family gives it :data:`LLAMA_PLAN`, whose tensor-parallel plan is
Megatron-LM's (arXiv 1909.08053) with sequence parallel (arXiv 2205.05198): see
:func:`llama_tp_plan`. Qwen3 (models/qwen3/) uses the same plan, which reads QK-norm off the model.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from models.common.decoder import FeedForward
from parallelisms.parallelize import ParallelizePlan
from parallelisms.tensor_parallel import ReplicateOnTP, TensorParallelPlan, VocabParallelEmbedding

__all__ = ["LLAMA_PLAN", "llama_tp_plan", "outer_tp_plan", "block_tp_plan"]


def llama_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
    """The tensor-parallel plan of a LLaMA ``Transformer`` (or pipeline stage): which module gets which
    ``ParallelStyle`` over the 1-D ``tp`` mesh (the driver applies it, parallelisms/tensor_parallel.py).

    Per block (Megatron-LM, arXiv 1909.08053, §3): attention wq/wk/wv column-parallel (each rank
    owns ``n_heads/tp`` query and ``n_kv_heads/tp`` key/value heads, so attention itself runs on
    local heads with no communication) and wo row-parallel; feed-forward w1/w3 column-parallel and
    w2 row-parallel. Each sub-block is then one column→row pair: without sequence parallel one
    all-reduce in forward (after wo / w2) and one in backward (at the input of wq/wk/wv / w1/w3).

    With ``sequence_parallel`` (arXiv 2205.05198, §4.2.2) the residual stream between sub-blocks is
    a sequence shard ``[B, S/tp, dim]``: the RMSNorms run on shards (their weights are replicated
    DTensors whose gradients are all-reduced), each sub-block's input is all-gathered to
    ``[B, S, dim]`` and its row-parallel output reduce-scattered back to ``[B, S/tp, dim]``.

    Embedding: vocab-parallel (:class:`VocabParallelEmbedding`: vocab rows sharded, each rank looks up
    the ids it owns, the partial embeddings are summed, or reduce-scattered onto sequence shards; its
    weight gradient is the local row shard). Output: column-parallel over
    the vocab; with ``loss_parallel`` its logits stay a ``[B, S, vocab]`` DTensor sharded on the
    vocab dim (``Shard(-1)``), which the trainer's cross entropy consumes inside ``loss_parallel()``;
    without it they are all-gathered to a plain ``[B, S, vocab]`` tensor.

    Attention must see plain local tensors (DTensor has no sharding rule for the CPU attention
    kernel): the column-parallel projections return local tensors (``use_local_output``), and the
    model's ``view(..., -1, head_dim)`` picks up the local head counts.

    Tied embeddings stay tied: both weights are sharded on the vocab dim, so the output re-uses the
    embedding's DTensor (``apply_tp_plan`` keeps shared parameters shared).

    Blocks whose feed-forward is not LLaMA's ``FeedForward`` (an MoE layer) keep it out of the plan:
    their family's plan shards it (models/common/moe_parallelize.py).

    Returns:
        (module, style or {sub-module name: style}) pairs: the model's embedding, final norm and
        output, then each block.
    """
    qk_norm = any(getattr(block.attention, "qk_norm", False) for block in model.layers.values())
    pairs = [(model, outer_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                   replicate_norm=qk_norm))]
    for block in model.layers.values():
        plan = block_tp_plan(sequence_parallel, qk_norm=qk_norm)
        if not isinstance(block.feed_forward, FeedForward):
            # Another feed-forward (e.g. an MoE layer): its model family's plan shards it.
            plan = {name: style for name, style in plan.items() if not name.startswith("feed_forward")}
        pairs.append((block, plan))
    return pairs


def outer_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool, replicate_norm: bool) -> dict:
    """The plan of what lies outside the blocks (see :func:`llama_tp_plan`): the vocab-parallel
    embedding, the final norm (sequence-parallel with SP; else a Replicate DTensor when
    ``replicate_norm``, i.e. when the blocks hold other replicated norm weights) and the output head.
    """
    # Layout of the residual stream between sub-blocks: sequence shards with SP, else replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = VocabParallelEmbedding(output_layouts=stream)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    elif model.norm is not None and replicate_norm:
        plan["norm"] = ReplicateOnTP()  # see block_tp_plan: one kind of tensor among the norm weights
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def block_tp_plan(sequence_parallel: bool, qk_norm: bool = False) -> dict:
    """The per-block TP plan (module names relative to a ``TransformerBlock``).

    With ``qk_norm`` (Qwen3's RMSNorm of each head's queries and keys, weight [head_dim]): each tp
    rank normalizes its own heads, so the weight is a replicated DTensor and its input the local
    heads, a ``Shard(2)`` of [B, S, heads, head_dim] (torch's ``SequenceParallel`` on dim 2, which
    hands back the local tensor). The weight's gradient is then a sum over all heads: each rank's
    partial sum over its heads is all-reduced over tp (a plain, unsharded weight would keep only its
    own heads' part, and the tp ranks' copies would drift apart). Without sequence parallel the
    block's RMSNorm weights then become replicated DTensors too (:class:`ReplicateOnTP`: computed on
    the same full sequence on every rank, so with no communication), as is the final norm: the
    optimizer's fused and foreach kernels take one kind of tensor per parameter group, and all norm
    weights share the group without weight decay.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # Each sub-block's input becomes one Replicate DTensor shared by its column-parallel
        # projections: with SP that is the all-gather of the norm's sequence shards; in backward
        # the projections' partial input gradients add up as a DTensor and are reduced once (one
        # reduce-scatter, or one all-reduce without SP: Megatron's "f" operator) instead of once
        # per projection. cos/sin (RoPE tables) pass through untouched.
        "attention": PrepareModuleInput(
            input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    elif qk_norm:
        plan["attention_norm"] = ReplicateOnTP()
        plan["ffn_norm"] = ReplicateOnTP()
    if qk_norm:
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


LLAMA_PLAN = ParallelizePlan(tensor_parallel=llama_tp_plan)
