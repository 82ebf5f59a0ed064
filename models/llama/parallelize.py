"""The LLaMA parallelization plan: which parallelism wraps which module, in a fixed order.

Order: TP → EP → CP → activation checkpointing → compile → FSDP/HSDP or DDP (as in TorchTitan).
Tensor parallel comes first because it swaps parameters for DTensors on the ``tp`` mesh, which every
later wrapper must see: activation checkpointing and compile wrap the already-sharded blocks, and
FSDP, always last, must see the final module structure (wrapped, compiled blocks) to place its
per-block units and shards the TP DTensors once more over dp_shard (2-D: FSDP across, TP within).

The TP plan is Megatron-LM's (arXiv 1909.08053) with sequence parallel (arXiv 2205.05198): see
:func:`apply_tp_llama`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from models.llama.model import FeedForward
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import ContextParallel, apply_cp
from parallelisms.data_parallel import apply_ddp, apply_fsdp, reshard_setting
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import (
    ReplicateOnTP,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    enable_async_tp,
    wait_async_output,
)


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    parallelism_cfg,
    ac_cfg,
    compile_cfg,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    context_parallel: ContextParallel | None = None,
    global_batch_size: int = 0,
    backend: str | None = None,
    shard_inner_units=None,
) -> nn.Module:
    """Apply the configured parallelisms to ``model`` (a full model or one pipeline stage) in place.

    Args:
        model: LLaMA ``Transformer`` on the meta device (or any device).
        parallel_dims: validated degrees with the mesh built (when world_size > 1).
        parallelism_cfg: ``[parallelism]`` (sequence_parallel, loss_parallel, async_tp,
            fsdp_reshard_after_forward, cp_rotate_method).
        ac_cfg: ``[activation_checkpoint]``; compile_cfg: ``[compile]``.
        param_dtype, reduce_dtype: ``training.mixed_precision_param`` / ``_reduce`` ("float32", "bfloat16").
        context_parallel: the run's cp layout when ``cp > 1`` (its positions bind the attention).
        global_batch_size: sequences per optimizer step (unused by the dense model; see the MoE plan).
        backend: process-group backend ("gloo", "nccl") or None for one process.
        shard_inner_units: None, or ``model -> None`` run in the FSDP step, after CP, AC and compile
            and just before the blocks are sharded: a family's own FSDP units inside the blocks
            (the MoE plan shards its experts on their own mesh there), which the blocks' units
            then skip.

    Returns:
        The same module, parallelized.
    """
    if parallel_dims.tp_enabled:
        apply_tp_llama(
            model,
            parallel_dims.mesh("tp"),
            sequence_parallel=parallelism_cfg.sequence_parallel,
            loss_parallel=parallelism_cfg.loss_parallel,
        )
        if parallelism_cfg.async_tp:  # accepted by validate_llama_parallelism: CUDA + compile + SP
            enable_async_tp()
        if compile_cfg.enable and model.tok_embeddings is not None:
            wait_async_output(model.tok_embeddings)  # its output is the first compiled block's input
    if parallel_dims.cp_enabled:
        # Attention over the whole cp-split sequence; inputs, labels and RoPE rows are sharded per
        # step by the runner (engine/train/runner.py) with the same ContextParallel.
        apply_cp(model, context_parallel, rotate_method=parallelism_cfg.cp_rotate_method)
    apply_activation_checkpointing(model, ac_cfg.mode, ac_cfg.selective_ac_option)
    if compile_cfg.enable:
        apply_compile(model, backend=compile_cfg.backend)

    if parallel_dims.fsdp_enabled:
        if shard_inner_units is not None:
            shard_inner_units(model)
        # HSDP: shard within dp_shard, replicate across dp_replicate.
        mesh_name = "hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_cp"
        apply_fsdp(
            model,
            parallel_dims.mesh(mesh_name),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_setting(parallelism_cfg.fsdp_reshard_after_forward,
                                                  parallel_dims.pp_enabled),
            backend=backend or "gloo",
        )
    elif parallel_dims.ddp_enabled:
        apply_ddp(
            model,
            parallel_dims.mesh("dp_replicate"),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            backend=backend or "gloo",
        )
    return model


def apply_tp_llama(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard a LLaMA ``Transformer`` (or pipeline stage) over the 1-D ``tp_mesh``, in place.

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
    embedding's DTensor.
    """
    # Layout of the residual stream between sub-blocks: sequence shards with SP, else replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    tied = (
        model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    qk_norm = any(getattr(block.attention, "qk_norm", False) for block in model.layers.values())
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = VocabParallelEmbedding(output_layouts=stream)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    elif model.norm is not None and qk_norm:
        plan["norm"] = ReplicateOnTP()  # see _block_plan: one kind of tensor among the norm weights
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    apply_tensor_parallel(model, tp_mesh, plan)
    if tied:
        # parallelize_module distributes each module's weight separately; share the one DTensor.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = _block_plan(sequence_parallel, qk_norm=qk_norm)
        if not isinstance(block.feed_forward, FeedForward):
            # Another feed-forward (e.g. an MoE layer): its model family's plan shards it.
            plan = {name: style for name, style in plan.items() if not name.startswith("feed_forward")}
        apply_tensor_parallel(block, tp_mesh, plan)


def _block_plan(sequence_parallel: bool, qk_norm: bool = False) -> dict:
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
