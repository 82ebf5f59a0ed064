"""Data parallelism over a sub-mesh: FSDP2 (ZeRO-3), HSDP, and DDP — all through torch's FSDP2 code.

ZeRO stage 3 (Rajbhandari et al. 2020, arXiv 1910.02054) as PyTorch FSDP (Zhao et al. 2023, arXiv
2304.11277). FSDP2 (``fully_shard``) shards every parameter, gradient and optimizer state
over the sharding mesh: per block, forward all-gathers the weights, computes and frees them; backward
all-gathers again and reduce-scatters the gradients. HSDP uses a 2-D mesh (replicate, shard): shards
within a group, all-reduces across groups. DDP is torch's FSDP2-based ``replicate`` (one replica per
rank, gradients all-reduced), so the three modes share one gradient path.

Gradient reduction is a *sum*, not a mean: the trainer's loss is already the token sum divided by the
global label-token count of the step (over all dp ranks and microbatches), so summing the per-rank
gradients gives exactly the single-process gradient, whatever the layout.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_RESHARD_CHOICES = ("default", "always", "never")
# ``training.mixed_precision_param`` / ``mixed_precision_reduce`` -> the dtype FSDP2 / DDP use.
MIXED_PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Each FSDP unit's configured reshard-after-forward (restored after a step without per-microbatch sync).
_RESHARD_AFTER_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mixed_precision_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for the config's dtype names ("float32" / "bfloat16"): compute parameters in
    ``param_dtype``, reduce gradients in ``reduce_dtype``; the sharded fp32 master weights stay."""
    return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_DTYPES[param_dtype],
                                reduce_dtype=MIXED_PRECISION_DTYPES[reduce_dtype])


def replicated_for_mixed_precision(parallel_dims, param_dtype: str, reduce_dtype: str) -> bool:
    """Whether a layout without FSDP or DDP is wrapped in DDP over its 1-rank ``dp_replicate`` mesh
    anyway, so that bfloat16 reaches it through FSDP2's ``MixedPrecisionPolicy`` as on every FSDP /
    HSDP / DDP layout: one mixed-precision recipe per run, whatever the layout (bfloat16 parameters
    gathered per unit, unit inputs cast to bfloat16, gradients reduced in ``reduce_dtype``; see the
    torch.distributed.fsdp.MixedPrecisionPolicy docs). ``torch.autocast`` casts per operation
    instead and keeps the residual stream in float32, a different numerics that parity against
    FSDP layouts sees (on the tests' model fsdp2, tp2 and fsdp2xtp2 were 6e-3 off in grad norm at
    step 2 where the bfloat16 noise floor allowed 5e-4; tests/integration/test_parity_noise_bf16.py).

    True when a device mesh exists (every launch, also one process under torchrun), neither FSDP
    nor DDP applies, and either dtype is bfloat16. A process without a process group (a Trainer
    built in plain Python) has no mesh and keeps autocast (engine/train/runner.py's StepContext).

    Args:
        parallel_dims: the run's ParallelDims (fsdp_enabled, ddp_enabled, mesh_built).
        param_dtype / reduce_dtype: ``training.mixed_precision_param`` / ``_reduce``.
    """
    if parallel_dims.fsdp_enabled or parallel_dims.ddp_enabled or not parallel_dims.mesh_built:
        return False
    return "bfloat16" in (param_dtype, reduce_dtype)


def mixed_precision_by_policy(parallel_dims, param_dtype: str, reduce_dtype: str) -> bool:
    """Whether FSDP2's ``MixedPrecisionPolicy`` applies the run's dtypes (FSDP, HSDP, DDP, or the 1-rank
    DDP of :func:`replicated_for_mixed_precision`); False: the forward needs bfloat16 autocast when
    ``param_dtype`` is bfloat16 (a process without a mesh)."""
    return (parallel_dims.fsdp_enabled or parallel_dims.ddp_enabled
            or replicated_for_mixed_precision(parallel_dims, param_dtype, reduce_dtype))


def reshard_setting(setting: str, pp_enabled: bool) -> str:
    """``parallelism.fsdp_reshard_after_forward`` as applied: under pipeline parallel a stage runs
    several microbatches back to back, and re-gathering its weights for each costs more than keeping
    them, so "default" means "never" there.

    Raises:
        ValueError: an unknown setting.
    """
    if setting not in _RESHARD_CHOICES:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward = {setting!r}: choose one of {', '.join(_RESHARD_CHOICES)}."
        )
    return "never" if pp_enabled and setting == "default" else setting


def shard_module(module: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, *, reshard: bool,
                 backend: str, shard_placement_fn=None) -> None:
    """One FSDP2 unit: ``fully_shard`` with gradients *summed* over ``mesh`` (see the module
    docstring), the one place every plan (blocks, root, MoE experts) shards through.

    Args:
        module: the unit's module; mesh: 1-D (FSDP) or 2-D (replicate, shard) mesh (HSDP).
        policy: from :func:`mixed_precision_policy`; reshard: free gathered weights after forward.
        backend: process-group backend (gloo needs a forced-sum reduction).
        shard_placement_fn: FSDP2's per-parameter placement (default: Shard(0)).
    """
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard,
                shard_placement_fn=shard_placement_fn)
    _RESHARD_AFTER_FORWARD[module] = reshard
    _sum_gradients(module, backend)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model that keeps them in ``model.layers`` (a ModuleDict)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return list(layers.values())


def _sum_gradients(module: nn.Module, backend: str) -> None:
    """Make every FSDP unit below ``module`` reduce gradients with SUM (divide factor 1).

    gloo rejects ``ReduceOp.PREMUL_SUM`` ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), which FSDP2
    uses for a custom divide factor, so on gloo the reduction is forced to a plain sum.
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
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    backend: str = "gloo",
) -> None:
    """Shard ``model`` in place with FSDP2: each block of ``model.layers``, then the root.

    Args:
        model: the model (or pipeline stage); parameters may be on the meta device.
        dp_mesh: 1-D sharding mesh (FSDP) or 2-D (replicate, shard) mesh (HSDP).
        param_dtype / reduce_dtype: dtype names ("float32", "bfloat16") for unsharded compute
            parameters and for gradient reduction (fp32 master weights stay in the sharded params).
        reshard_after_forward: ``default`` frees gathered weights after each block's forward except
            the last block (backward needs it at once), ``always`` frees all (least memory),
            ``never`` keeps them gathered until backward (ZeRO-2-like, fewer all-gathers); see
            :func:`reshard_setting` for pipeline parallel.
        backend: process-group backend; gloo needs forced-sum gradient reduction.

    Raises:
        ValueError: an unknown ``reshard_after_forward``.
    """
    reshard_setting(reshard_after_forward, pp_enabled=False)  # refuses unknown values
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    blocks = _blocks(model)
    for index, block in enumerate(blocks):
        if reshard_after_forward == "default":
            reshard = index < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        shard_module(block, dp_mesh, policy, reshard=reshard, backend=backend)
    # The root unit holds embeddings, final norm and output head; backward needs them right away.
    shard_module(model, dp_mesh, policy, reshard=reshard_after_forward == "always", backend=backend)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    backend: str = "gloo",
) -> None:
    """Replicate ``model`` over ``dp_mesh`` (DDP): full parameters per rank, gradients all-reduced.

    Uses torch's FSDP2-based ``replicate`` so mixed precision and the sum reduction work as for FSDP.
    Each block is its own unit so gradient all-reduce of late blocks overlaps backward of early ones
    (the gradient bucketing of PyTorch DDP, Li et al. 2020, arXiv 2006.15704).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
    for block in _blocks(model):
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradients(model, backend)


@contextlib.contextmanager
def sync_on_last_microbatch(model: nn.Module, microbatches: int) -> Iterator[Iterator[None]]:
    """Gradient accumulation with one gradient reduction per step instead of one per microbatch.

    Yields an iterator to advance once before each microbatch's forward. Every FSDP2 / DDP unit of
    ``model`` skips its gradient reduce-scatter / all-reduce on microbatches ``1 .. A-1`` and reduces
    the accumulated gradient after the last one (FSDP's ``set_requires_gradient_sync``, the FSDP2
    counterpart of ``no_sync()``, Zhao et al. 2023, arXiv 2304.11277 §3.3). FSDP units also keep their
    weights gathered for the whole step (no reshard after forward or backward until the last
    backward), so a step costs one all-gather and one reduce-scatter per unit whatever the number
    of microbatches A (per microbatch otherwise: 2 all-gathers with resharding, and a reduce-scatter).

    Memory cost: for the whole step every rank holds the unsharded parameters (in the compute dtype)
    and unsharded gradients (in the reduce dtype) of the model: P·(b_param + b_reduce) bytes for P
    parameters instead of 1/dp_shard of it; DDP already holds them. Optimizer state stays sharded.

    Args:
        model: the model part (FSDP/DDP units anywhere below it; none: nothing changes).
        microbatches: A, the microbatches of the step.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    sharded = [u for u in units if u in _RESHARD_AFTER_FORWARD]  # DDP units never reshard

    def advance() -> Iterator[None]:
        for index in range(microbatches):
            last = index == microbatches - 1
            for unit in units:
                unit.set_requires_gradient_sync(last, recurse=False)
            for unit in sharded:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(last, recurse=False)
            yield

    try:
        yield advance()
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
        for unit in sharded:
            unit.set_reshard_after_forward(_RESHARD_AFTER_FORWARD[unit], recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
