"""The MoE parallelization plan: expert parallel for the routed experts, LLaMA's plan for the rest.

Order: TP → EP → CP → activation checkpointing → compile → FSDP/HSDP. An MoE
model is a LLaMA model whose MoE blocks differ only in the feed-forward, so after the MoE-specific
steps 0-1 below this calls :func:`models.llama.parallelize.parallelize_llama`, which applies TP, CP,
activation checkpointing, compile and FSDP to everything else, and runs step 2 in its FSDP step
(``shard_inner_units``), after CP, AC and compile, just before the blocks are sharded:

0. tensor parallel (``tp > 1``): LLaMA's plan shards attention, embeddings, output and the dense
   layers and leaves MoE feed-forwards alone; each MoE layer then runs on the whole (all-gathered)
   sequence, and hands back the residual stream's layout (its sequence shard under sequence
   parallel). Shared experts are Megatron column/row parallel like a dense feed-forward; the router
   and the routed experts are replicated on the tp ranks (Replicate DTensors, computing on local
   tensors): the tp ranks see the same tokens, so they compute the same routing, outputs and
   gradients, and no reduction over tp is needed. This repeats the routed-expert compute on every
   tp rank; splitting the tokens over tp (ep reaching into tp) would not, and is the next step;
1. expert parallel (``ep > 1``): each MoE layer's ``experts`` get the ``ExpertParallel`` style on the
   ``ep`` mesh (weights sharded by expert, tokens moved by all-to-all);
2. FSDP of the experts over the ranks left after ep (``dp_shard_mod_ep``, with ``dp_replicate`` as
   HSDP): an expert's weights live on one ep rank of each group, so they are sharded and their
   gradients summed only over the ranks holding the same experts. The parent block's FSDP unit then
   skips them. Gradients come out exact, not ep times too large: the all-to-all backward brings each
   expert the gradient of every token routed to it, and FSDP *sums* over the other groups (the
   trainer's loss is already divided by the global token count; parallelisms/data_parallel.py).

The model also learns two things it cannot know on its own: which ranks see different tokens
(``token_group``, for the global routing counts) and how many sequences an optimizer step has (to
make the balance loss a per-sequence mean independent of the layout).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from models.llama.parallelize import parallelize_llama
from parallelisms.data_parallel import mixed_precision_policy, reshard_setting, shard_module
from parallelisms.expert_parallel import ExpertParallel
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import ReplicateOnTP

__all__ = ["parallelize_moe"]


def parallelize_moe(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    parallelism_cfg,
    ac_cfg,
    compile_cfg,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    context_parallel=None,
    global_batch_size: int,
    backend: str | None = None,
) -> nn.Module:
    """Apply the configured parallelisms to an ``MoETransformer`` (or a pipeline stage) in place.

    Args: as :func:`models.llama.parallelize.parallelize_llama`; ``global_batch_size`` (sequences
    per optimizer step, resolved by engine/data/batch_sizes.py) scales the balance loss.

    Returns:
        The same module, parallelized.
    """
    # The balance loss is a mean over the step's sequences; under context parallel each cp rank
    # adds its share of every sequence's loss (MoE._balance_loss), the same value as one process.
    model.set_aux_loss_scale(global_batch_size)
    if parallel_dims.mesh_built:
        model.token_group = parallel_dims.mesh("dp_cp").get_group()
        if parallel_dims.cp_enabled:
            for moe in model.moe_layers():
                moe.cp_group = parallel_dims.mesh("cp").get_group()
    if parallel_dims.tp_enabled:
        for moe in model.moe_layers():
            _apply_tp_moe(moe, parallel_dims.mesh("tp"), parallelism_cfg.sequence_parallel, parallel_dims.ep_enabled)
    if parallel_dims.ep_enabled:
        ep_mesh = parallel_dims.mesh("ep")
        for moe in model.moe_layers():
            parallelize_module(moe.experts, ep_mesh, ExpertParallel())

    def shard_experts(part: nn.Module) -> None:  # FSDP is always on with ep > 1: ep divides dp_shard × cp
        if parallel_dims.ep_enabled:
            _shard_experts(part, parallel_dims, parallelism_cfg, param_dtype, reduce_dtype, backend or "gloo")

    return parallelize_llama(
        model, parallel_dims, parallelism_cfg=parallelism_cfg, ac_cfg=ac_cfg, compile_cfg=compile_cfg,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, context_parallel=context_parallel,
        global_batch_size=global_batch_size, backend=backend, shard_inner_units=shard_experts,
    )


def _apply_tp_moe(moe: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, ep_enabled: bool) -> None:
    """The MoE layer under tensor parallel (see the module docstring, step 0)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(moe, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True,
    ))
    parallelize_module(moe.router.gate, tp_mesh, ReplicateOnTP())
    if moe.shared_experts is not None:
        parallelize_module(moe.shared_experts, tp_mesh, {
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Replicate()),
        })
    if not ep_enabled:  # else they are sharded on the ep mesh; GroupedExperts uses local weights
        distribute_module(moe.experts, tp_mesh)


def _shard_experts(model: nn.Module, parallel_dims: ParallelDims, parallelism_cfg, param_dtype: str,
                   reduce_dtype: str, backend: str) -> None:
    """FSDP (HSDP with dp_replicate) of each expert-parallel experts module over the non-ep ranks."""
    mesh = parallel_dims.mesh("ep_hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_mod_ep")
    shard_size = parallel_dims.mesh("dp_shard_mod_ep").size()
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    # As for the blocks ("default": free after forward, but keep them across microbatches under PP).
    reshard = reshard_setting(parallelism_cfg.fsdp_reshard_after_forward, parallel_dims.pp_enabled) != "never"
    for moe in model.moe_layers():
        local_experts = moe.experts.w1.to_local().shape[0]

        def placement(param, _local=local_experts):
            # Fewer local experts than shards: shard inside each expert (dim 1) so no rank is empty.
            if _local % shard_size != 0 and param.shape[1] % shard_size == 0:
                return Shard(1)
            return Shard(0)

        shard_module(moe.experts, mesh, policy, reshard=reshard, backend=backend, shard_placement_fn=placement)
