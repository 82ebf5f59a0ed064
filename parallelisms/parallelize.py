"""The one parallelize driver: every family's model (or pipeline stage) goes through the same steps.

Order: TP → EP → CP → activation checkpointing → compile → FSDP/HSDP or DDP (as in TorchTitan's
``parallelize_llama``). Tensor parallel comes first because it swaps parameters for DTensors on the
``tp`` mesh, which every later wrapper must see: activation checkpointing and compile wrap the
already-sharded blocks, and FSDP, always last, must see the final module structure (wrapped,
compiled blocks) to place its per-block units, and shards the TP DTensors once more over dp_shard
(2-D: FSDP across, TP within).

A family takes part as data, a :class:`ParallelizePlan` in its ``models/<family>/parallelize.py``
that its ``ModelSpec.parallelize_plan`` names: its tensor-parallel plan (which module gets which
``ParallelStyle``; parallelisms/tensor_parallel.py applies it) and, for a family with routed experts,
an :class:`ExpertPlan` (where its experts are and what its model must be told), from which this
driver runs the expert steps: the experts replicated on the tp ranks or split over the ep ranks
(parallelisms/expert_parallel.py), and their own FSDP units over the ranks left after ep, just
before the blocks are sharded. Every other step is model-agnostic: context parallel binds every
module with an ``attention_fn`` slot, activation checkpointing and compile wrap the blocks of
``model.layers``, FSDP shards each block and the root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import distribute_module
from torch.distributed.tensor.parallel import parallelize_module

from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import ContextParallel, apply_cp
from parallelisms.data_parallel import apply_ddp, apply_fsdp, replicated_for_mixed_precision, reshard_setting
from parallelisms.expert_parallel import ExpertParallel, shard_experts
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import TensorParallelPlan, apply_tp_plan, enable_async_tp, wait_async_output

__all__ = ["ExpertPlan", "ParallelizePlan", "parallelize"]


@dataclass(frozen=True)
class ExpertPlan:
    """A family's routed experts, for the driver's expert steps.

    Attributes:
        layers: ``model -> [MoE layer]``: the mixture-of-experts layers of the model (or pipeline
            stage), each with an ``experts`` module whose forward is ``(x [N, dim] grouped by
            expert, counts [E]) -> [N, dim]`` and whose weights are stacked per expert on dim 0
            (``w1`` among them).
        bind: ``(model, *, token_group, cp_group, tp_group, sequences_per_step) -> None``, called
            first (before tensor parallel, whose plan reads it): what the model cannot know on its
            own: the process group of the ranks whose tokens differ (data × context parallel; None
            on one process) for the global routing counts, the group one sequence's routed tokens are
            spread over (cp, and tp too when the experts span tp; None if one rank), the tp group
            when the routed experts are split over tp (each tp rank then routes its own sequence
            shard; None otherwise), and the sequences of an optimizer step (all ranks, all
            microbatches) that make the balance loss a per-sequence mean.
    """

    layers: Callable[[nn.Module], list[nn.Module]]
    bind: Callable[..., None]


@dataclass(frozen=True)
class ParallelizePlan:
    """What a family gives the driver (``ModelSpec.parallelize_plan`` names it).

    Attributes:
        tensor_parallel: ``(model, *, sequence_parallel, loss_parallel) -> TensorParallelPlan``: the
            (module, style or {sub-module name: style}) pairs that shard this model or pipeline
            stage over tp (parallelisms/tensor_parallel.py ``apply_tp_plan``).
        experts: the routed experts, or None for a dense family.
    """

    tensor_parallel: Callable[..., TensorParallelPlan]
    experts: ExpertPlan | None = None


def parallelize(
    model: nn.Module,
    parallel_dims: ParallelDims,
    plan: ParallelizePlan,
    *,
    parallelism_cfg,
    ac_cfg,
    compile_cfg,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    context_parallel: ContextParallel | None = None,
    global_batch_size: int = 0,
    backend: str | None = None,
    float8_tensorwise: bool = False,
) -> nn.Module:
    """Apply the configured parallelisms to ``model`` (a full model or one pipeline stage) in place,
    in the order of the module docstring.

    Args:
        model: the family's module on the meta device (or any device); ``tok_embeddings``, ``norm``
            and ``output`` may be None (pipeline stages), blocks live in ``model.layers``.
        parallel_dims: validated degrees with the mesh built (when world_size > 1).
        plan: the family's :class:`ParallelizePlan`.
        parallelism_cfg: ``[parallelism]`` (sequence_parallel, loss_parallel, async_tp,
            fsdp_reshard_after_forward, cp_rotate_method).
        ac_cfg: ``[activation_checkpoint]``; compile_cfg: ``[compile]``.
        param_dtype, reduce_dtype: ``training.mixed_precision_param`` / ``_reduce`` ("float32",
            "bfloat16", "float64").
        context_parallel: the run's cp layout when ``cp > 1`` (its positions bind the attention).
        global_batch_size: sequences per optimizer step (engine/data/batch_sizes.py); only a family
            with experts receives it (``ExpertPlan.bind``).
        backend: process-group backend ("gloo", "nccl") or None for one process.
        float8_tensorwise: the model holds torchao ``Float8Linear`` layers of the tensorwise recipe:
            the tensor-parallel plan gets torchao's float8 styles (parallelisms/float8.py), except
            on gloo, which cannot all-gather float8 tensors.

    Returns:
        The same module, parallelized.
    """
    backend = backend or "gloo"
    experts = plan.experts
    if experts is not None:
        _bind_experts(model, parallel_dims, experts, global_batch_size)
    if parallel_dims.tp_enabled:
        # gloo has no float8 collectives: there the float8 linears cast the all-gathered high-precision
        # activation themselves (the same amax, so the same float8 values; only the wire dtype differs).
        _tensor_parallel(model, parallel_dims, plan, parallelism_cfg, compile_cfg,
                         float8_tensorwise and backend != "gloo")
    if experts is not None:
        _expert_parallel(model, parallel_dims, experts)
    if parallel_dims.cp_enabled:
        # Attention over the whole cp-split sequence; inputs, labels and RoPE rows are sharded per
        # step by the runner (engine/train/runner.py) with the same ContextParallel.
        apply_cp(model, context_parallel, rotate_method=parallelism_cfg.cp_rotate_method)
    apply_activation_checkpointing(model, ac_cfg.mode, ac_cfg.selective_ac_option)
    if compile_cfg.enable:
        apply_compile(model, backend=compile_cfg.backend, distributed=parallel_dims.world_size > 1)
    if parallel_dims.fsdp_enabled:
        if experts is not None and parallel_dims.ep_enabled:  # ep > 1 beside tp always has FSDP
            shard_experts([layer.experts for layer in experts.layers(model)], parallel_dims,
                          param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                          reshard_after_forward=parallelism_cfg.fsdp_reshard_after_forward, backend=backend)
        # HSDP: shard within dp_shard, replicate across dp_replicate.
        apply_fsdp(model, parallel_dims.mesh("hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_cp"),
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, backend=backend,
                   reshard_after_forward=reshard_setting(parallelism_cfg.fsdp_reshard_after_forward,
                                                         parallel_dims.pp_enabled))
    elif parallel_dims.ddp_enabled or replicated_for_mixed_precision(parallel_dims, param_dtype, reduce_dtype):
        # DDP, or bfloat16 on a layout without data parallel: the same MixedPrecisionPolicy as FSDP
        apply_ddp(model, parallel_dims.mesh("dp_replicate"), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                  backend=backend)
    return model


def _bind_experts(model: nn.Module, parallel_dims: ParallelDims, experts: ExpertPlan, sequences_per_step: int):
    """Tell the model its token group, cp group and sequences per step (:class:`ExpertPlan`)."""
    built = parallel_dims.mesh_built
    over_tp = built and parallel_dims.ep_over_tp
    sequence_mesh = "cp_tp" if over_tp else "cp"
    spread = over_tp or parallel_dims.cp_enabled
    experts.bind(model, token_group=parallel_dims.mesh("dp_cp").get_group() if built else None,
                 cp_group=parallel_dims.mesh(sequence_mesh).get_group() if built and spread else None,
                 tp_group=parallel_dims.mesh("tp").get_group() if over_tp else None,
                 sequences_per_step=sequences_per_step)


def _tensor_parallel(model: nn.Module, parallel_dims: ParallelDims, plan: ParallelizePlan, parallelism_cfg,
                     compile_cfg, float8_tensorwise: bool = False) -> None:
    """The family's TP plan over the ``tp`` mesh (with torchao's float8 styles for tensorwise float8
    linears), and async TP when asked for."""
    pairs = plan.tensor_parallel(model, sequence_parallel=parallelism_cfg.sequence_parallel,
                                 loss_parallel=parallelism_cfg.loss_parallel)
    if float8_tensorwise:
        from parallelisms.float8 import float8_tp_plan

        pairs = float8_tp_plan(pairs)
    apply_tp_plan(model, parallel_dims.mesh("tp"), pairs)
    if parallelism_cfg.async_tp:  # accepted by the family's start-up check: CUDA + compile + SP
        enable_async_tp()
    if compile_cfg.enable and model.tok_embeddings is not None:
        wait_async_output(model.tok_embeddings)  # its output is the first compiled block's input


def _expert_parallel(model: nn.Module, parallel_dims: ParallelDims, experts: ExpertPlan) -> None:
    """Routed experts: split over the ``ep`` ranks (``ExpertParallel``: weights sharded by expert,
    tokens moved by all-to-all), or, with tp but no ep, replicated on the tp ranks: those see the
    same tokens, so they compute the same routing, outputs and gradients, and nothing is reduced
    over tp (the experts compute on local weights; Replicate DTensors so that clipping and the
    optimizer see one kind of tensor). When ep spans tp (``ParallelDims.ep_over_tp``) the ep mesh
    holds the tp ranks and each tp rank dispatches its own sequence shard (the family's TP plan keeps
    the MoE input sequence-sharded: models/common/moe_parallelize.py)."""
    if parallel_dims.ep_enabled:
        ep_mesh = parallel_dims.mesh("ep")
        for layer in experts.layers(model):
            parallelize_module(layer.experts, ep_mesh, ExpertParallel())
    elif parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.mesh("tp")
        for layer in experts.layers(model):
            distribute_module(layer.experts, tp_mesh)
