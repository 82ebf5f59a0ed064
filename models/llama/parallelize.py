"""The LLaMA parallelization plan: which parallelism wraps which module, in a fixed order.

Order (DESIGN.md rule 2): TP → EP → CP → activation checkpointing → compile → FSDP/HSDP or DDP.
Tensor, expert and context parallel plug in ahead of activation checkpointing when their issues
land; data parallel always comes last because FSDP must see the final module structure (wrapped,
compiled blocks) to place its per-block units.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import apply_compile
from parallelisms.data_parallel import apply_ddp, apply_fsdp
from parallelisms.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    parallelism_cfg,
    training_cfg,
    ac_cfg,
    compile_cfg,
    backend: str | None,
) -> nn.Module:
    """Apply the configured parallelisms to ``model`` (a full model or one pipeline stage) in place.

    Args:
        model: LLaMA ``Transformer`` on the meta device (or any device).
        parallel_dims: validated degrees with the mesh built (when world_size > 1).
        parallelism_cfg: ``[parallelism]`` (fsdp_reshard_after_forward).
        training_cfg: ``[training]`` (mixed_precision_param, mixed_precision_reduce).
        ac_cfg: ``[activation_checkpoint]``; compile_cfg: ``[compile]``.
        backend: process-group backend ("gloo", "nccl") or None for one process.

    Returns:
        The same module, parallelized.
    """
    apply_activation_checkpointing(model, ac_cfg.mode, ac_cfg.selective_ac_option)
    if compile_cfg.enable:
        apply_compile(model, backend=compile_cfg.backend)

    param_dtype = DTYPES[training_cfg.mixed_precision_param]
    reduce_dtype = DTYPES[training_cfg.mixed_precision_reduce]
    if parallel_dims.fsdp_enabled:
        # HSDP: shard within dp_shard, replicate across dp_replicate.
        mesh_name = "hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_cp"
        apply_fsdp(
            model,
            parallel_dims.mesh(mesh_name),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=parallelism_cfg.fsdp_reshard_after_forward,
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
