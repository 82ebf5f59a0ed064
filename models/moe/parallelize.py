"""The MoE parallelization plan: expert parallel for the routed experts, LLaMA's plan for the rest.

Order (DESIGN.md rule 2): TP → EP → CP → activation checkpointing → compile → FSDP/HSDP. An MoE
model is a LLaMA model whose MoE blocks differ only in the feed-forward, so after the MoE-specific
steps below this calls :func:`models.llama.parallelize.parallelize_llama`, which applies TP, CP,
activation checkpointing, compile and FSDP to everything else:

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
   trainer's loss is already divided by the global token count; ``set_gradient_divide_factor(1)``).

The model also learns two things it cannot know on its own: which ranks see different tokens
(``token_group``, for the global routing counts) and how many sequences an optimizer step has (to
make the balance loss a per-sequence mean independent of the layout).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from models.llama.parallelize import DTYPES, parallelize_llama
from parallelisms.expert_parallel import ExpertParallel
from parallelisms.parallel_dims import ParallelDims

__all__ = ["parallelize_moe", "validate_moe_parallelism"]


def parallelize_moe(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    parallelism_cfg,
    training_cfg,
    ac_cfg,
    compile_cfg,
    backend: str | None,
) -> nn.Module:
    """Apply the configured parallelisms to an ``MoETransformer`` (or a pipeline stage) in place.

    Args: as :func:`parallelize_llama`; ``training_cfg`` also gives the sequences per optimizer
    step (``global_batch_size``, or ``local_batch_size`` × dp when it is -1).

    Returns:
        The same module, parallelized.
    """
    sequences = training_cfg.global_batch_size
    if sequences <= 0:
        sequences = training_cfg.local_batch_size * parallel_dims.dp
    # Context parallel splits each sequence into cp pieces, and the balance loss (like a capacity)
    # is then taken per piece: a mean over pieces keeps it near 1 when routing is balanced.
    model.set_aux_loss_scale(sequences * parallel_dims.cp)
    if parallel_dims.mesh_built:
        model.token_group = parallel_dims.mesh("dp_cp").get_group()
    if parallel_dims.tp_enabled:
        for moe in model.moe_layers():
            _apply_tp_moe(moe, parallel_dims.mesh("tp"), parallelism_cfg.sequence_parallel, parallel_dims.ep_enabled)
    if parallel_dims.ep_enabled:
        ep_mesh = parallel_dims.mesh("ep")
        for moe in model.moe_layers():
            parallelize_module(moe.experts, ep_mesh, ExpertParallel())
        if parallel_dims.fsdp_enabled:  # always true with ep > 1: ep divides dp_shard × cp
            _shard_experts(model, parallel_dims, parallelism_cfg, training_cfg)
    return parallelize_llama(
        model, parallel_dims, parallelism_cfg=parallelism_cfg, training_cfg=training_cfg,
        ac_cfg=ac_cfg, compile_cfg=compile_cfg, backend=backend,
    )


class _ReplicateOnTP(ParallelStyle):
    """Parameters become Replicate DTensors on the tp mesh; the module computes on local tensors.

    Used where every tp rank runs the same computation on the same tokens: the gradients are then
    equal on every tp rank (Replicate is their true placement) and nothing is communicated.
    DTensors rather than plain tensors so that the optimizer's foreach kernels see one kind of
    tensor next to tensor parallel's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

        def to_local(_, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def _apply_tp_moe(moe: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, ep_enabled: bool) -> None:
    """The MoE layer under tensor parallel (see the module docstring, step 0)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(moe, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True,
    ))
    parallelize_module(moe.router.gate, tp_mesh, _ReplicateOnTP())
    if moe.shared_experts is not None:
        parallelize_module(moe.shared_experts, tp_mesh, {
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Replicate()),
        })
    if not ep_enabled:  # else they are sharded on the ep mesh; GroupedExperts uses local weights
        distribute_module(moe.experts, tp_mesh)


def _shard_experts(model: nn.Module, parallel_dims: ParallelDims, parallelism_cfg, training_cfg) -> None:
    """FSDP (HSDP with dp_replicate) of each expert-parallel experts module over the non-ep ranks."""
    mesh = parallel_dims.mesh("ep_hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_mod_ep")
    shard_size = parallel_dims.mesh("dp_shard_mod_ep").size()
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[training_cfg.mixed_precision_param],
        reduce_dtype=DTYPES[training_cfg.mixed_precision_reduce],
    )
    choice = parallelism_cfg.fsdp_reshard_after_forward
    # As for the blocks: under PP keep gathered weights across microbatches unless told otherwise.
    reshard = choice == "always" or (choice == "default" and not parallel_dims.pp_enabled)
    for moe in model.moe_layers():
        local_experts = moe.experts.w1.to_local().shape[0]

        def placement(param, _local=local_experts):
            # Fewer local experts than shards: shard inside each expert (dim 1) so no rank is empty.
            if _local % shard_size != 0 and param.shape[1] % shard_size == 0:
                return Shard(1)
            return Shard(0)

        fully_shard(moe.experts, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                    shard_placement_fn=placement)
    # Gradient sum (divide factor 1) and gloo's forced sum are set by apply_fsdp on every FSDP unit
    # below the model, these included.


