"""Data parallelism over a sub-mesh: FSDP2 (ZeRO-3), HSDP, and DDP — all through torch's FSDP2 code.

SEED.md §5 and §10. FSDP2 (``fully_shard``) shards every parameter, gradient and optimizer state
over the sharding mesh: per block, forward all-gathers the weights, computes and frees them; backward
all-gathers again and reduce-scatters the gradients. HSDP uses a 2-D mesh (replicate, shard): shards
within a group, all-reduces across groups. DDP is torch's FSDP2-based ``replicate`` (one replica per
rank, gradients all-reduced), so the three modes share one gradient path.

Gradient reduction is a *sum*, not a mean: the trainer's loss is already the token sum divided by the
global label-token count of the step (over all dp ranks and microbatches), so summing the per-rank
gradients gives exactly the single-process gradient, whatever the layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_RESHARD_CHOICES = ("default", "always", "never")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model that keeps them in ``model.layers`` (a ModuleDict)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return list(layers.values())


def _sum_gradients(module: nn.Module, backend: str) -> None:
    """Make every FSDP unit below ``module`` reduce gradients with SUM (divide factor 1).

    gloo rejects ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for a custom divide factor, so on gloo
    the reduction is forced to a plain sum (torch-cpu-facts.md).
    """
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            if backend == "gloo":
                sub.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    backend: str = "gloo",
) -> None:
    """Shard ``model`` in place with FSDP2: each block of ``model.layers``, then the root.

    Args:
        model: the model (or pipeline stage); parameters may be on the meta device.
        dp_mesh: 1-D sharding mesh (FSDP) or 2-D (replicate, shard) mesh (HSDP).
        param_dtype / reduce_dtype: ``MixedPrecisionPolicy`` dtypes for unsharded compute
            parameters and for gradient reduction (fp32 master weights stay in the sharded params).
        reshard_after_forward: ``default`` frees gathered weights after each block's forward except
            the last block (backward needs it at once), ``always`` frees all (least memory),
            ``never`` keeps them gathered until backward (ZeRO-2-like, fewer all-gathers).
        backend: process-group backend; gloo needs forced-sum gradient reduction.

    Raises:
        ValueError: an unknown ``reshard_after_forward``.
    """
    if reshard_after_forward not in _RESHARD_CHOICES:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward = {reshard_after_forward!r}: choose one of "
            f"{', '.join(_RESHARD_CHOICES)}."
        )
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = _blocks(model)
    for index, block in enumerate(blocks):
        if reshard_after_forward == "default":
            reshard = index < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    # The root unit holds embeddings, final norm and output head; backward needs them right away.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward == "always")
    _sum_gradients(model, backend)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    backend: str = "gloo",
) -> None:
    """Replicate ``model`` over ``dp_mesh`` (DDP): full parameters per rank, gradients all-reduced.

    Uses torch's FSDP2-based ``replicate`` so mixed precision and the sum reduction work as for FSDP.
    Each block is its own unit so gradient all-reduce of late blocks overlaps backward of early ones
    (DDP's bucketing, SEED.md §5).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in _blocks(model):
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradients(model, backend)
