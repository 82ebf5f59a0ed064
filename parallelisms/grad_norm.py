"""Global gradient norm and clipping for plain, sharded (DTensor) and pipeline-split gradients.

Gradients come in three kinds, often mixed in one model: plain tensors (one process; or a tensor
replicated by tensor parallel, e.g. an RMSNorm weight without sequence parallel, equal on every tp
rank), DTensors on the FSDP/HSDP mesh, and DTensors on the tp mesh or on a 2-D (dp_shard, tp) mesh
once FSDP shards a TP parameter again. Each gradient's squared L2 norm is computed on its local
shard; gradients are grouped by (mesh, the mesh dims they are sharded on), each group's sum is
all-reduced over exactly those dims (a replicated dim is not reduced, so a replicated copy is
counted once), and the groups are added. Pipeline stages hold disjoint parameters, so their squared
norms are summed over the pp group (``pp_group``).

Squares are accumulated in float64 (see :func:`_local_squared_sum`): torch's fp32 CPU norm of a
1M-element tensor is ~1e-5 off, which alone would make the measured norm depend on how the gradients
are sharded. The result is returned in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _reduced_dims(grad: DTensor) -> tuple[int, ...]:
    """The mesh dims over which ``grad``'s squared norm must be summed: the ones it is sharded on."""
    # "Not replicated" rather than is_shard(): FSDP's strided shard of a TP shard (the 2-D case)
    # answers is_shard() False. Partial gradients were reduced before (see _reduce_pending).
    return tuple(dim for dim, placement in enumerate(grad.placements) if not placement.is_replicate())


def _reduce_pending(params: list[torch.Tensor]) -> None:
    """Replace each Partial DTensor gradient by its reduced (Replicate) value, in place.

    Sequence parallel leaves such gradients on the RMSNorm weights: each tp rank holds the
    gradient from its own sequence shard, and their sum is the gradient. The norm of a sum is not
    the sum of norms, so they are reduced here, once, and the optimizer then reads the reduced ones.
    All pending gradients of one (mesh, placements) kind travel in one flat buffer, so a model with
    2 norms per block costs one all-reduce per step rather than one per norm weight (what
    ``DTensor.redistribute`` per gradient would issue).
    """
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            groups.setdefault((grad.device_mesh, tuple(grad.placements), grad.dtype), []).append(param)
    for (mesh, placements, _), members in groups.items():
        locals_ = [param.grad.to_local() for param in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                op = getattr(dist.ReduceOp, placement.reduce_op.upper())  # "sum" (autograd's partials)
                dist.all_reduce(flat, op=op, group=mesh.get_group(dim))
        reduced = [Replicate() if p.is_partial() else p for p in placements]
        for param, piece in zip(members, flat.split([t.numel() for t in locals_])):
            grad = param.grad
            param.grad = DTensor.from_local(piece.view_as(grad.to_local()), mesh, reduced,
                                            shape=grad.shape, stride=grad.stride(), run_check=False)


def _local_squared_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ of squared elements of ``tensors`` (one device), a 0-dim fp64 tensor.

    CPU: per-row fp32 norms over the last dim (rows of at most a few thousand elements, so their
    sequential fp32 sums stay exact to ~1e-7), then their squares summed in fp64: as accurate as an
    fp64 norm (3e-10 relative on the debug model) at the speed of torch's fp32 one, and independent
    of how dim 0 is sharded. Elsewhere: one ``torch._foreach_norm`` (tree reductions), squared in fp64.
    """
    if tensors[0].device.type == "cpu":
        rows = [torch.linalg.vector_norm(t.reshape(-1, t.shape[-1]) if t.ndim >= 2 else t.reshape(1, -1), 2.0, dim=1)
                for t in tensors]
        return torch.cat(rows).double().square().sum()
    return torch.stack(torch._foreach_norm(tensors, 2.0)).double().square().sum()


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ over ``grads`` of the squared L2 norm (fp64, 0-dim), each element counted once.

    Local shards are grouped by (mesh, sharded dims), plain tensors by device; each group's local
    sum (:func:`_local_squared_sum`) is all-reduced once per sharded mesh dim.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            groups.setdefault((grad.device_mesh, _reduced_dims(grad)), []).append(grad.to_local())
        else:
            groups.setdefault((grad.device, ()), []).append(grad)
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    # Every rank of a mesh holds the same parameters, hence the same keys in the same order, so
    # the reductions below are issued in the same order on all of them.
    for (mesh, dims), tensors in groups.items():
        local = _local_squared_sum(tensors).to(total.device)
        # One all-reduce per sharded mesh dim (what DTensor's Partial → Replicate would do, minus
        # its per-call warning about 2-D reductions); they are scalars, so latency is all they cost.
        for dim in dims:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + local
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
    foreach: bool | None = None,
    uncounted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Compute the global L2 norm of all gradients and, if ``max_norm > 0``, scale them to it.

    Args:
        parameters: every parameter of every model part on this rank (plain tensors and DTensors
            on any meshes may be mixed).
        max_norm: clipping threshold (same units as the gradient norm); <= 0 only measures.
        pp_group: pipeline-parallel group whose ranks hold the other stages' parameters.
        foreach: False scales the gradients one by one; None/True with one foreach call per
            (device, dtype).
        uncounted: parameters among ``parameters`` whose gradient is left out of the norm but
            clipped (a pipeline stage's copy of a parameter another stage counts,
            parallelisms/pipeline_tied.py).

    Returns:
        The total norm before clipping, a 0-dim fp32 tensor (fp64 for fp64 gradients) equal on every rank.

    Gradients with a pending reduction (Partial DTensors, e.g. sequence-parallel norm weights)
    are reduced first and replace ``param.grad``.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    _reduce_pending(params)
    grads = [p.grad for p in params]
    skip = {id(p) for p in uncounted}
    counted = [p.grad for p in params if id(p) not in skip]
    squared = _squared_norm(counted) if counted else torch.zeros((), dtype=torch.float64, device=grads[0].device)
    if pp_group is not None:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    # float32, or float64 for float64 gradients (the float64 reference mode): clip and log at that precision
    total_norm = squared.sqrt().to(torch.promote_types(grads[0].dtype, torch.float32))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        # Scale the local shards in place (to_local shares storage): one code path whatever mesh a
        # gradient lives on; a foreach over DTensors of different meshes is not supported.
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if foreach is False:
            for g in local:
                g.mul_(coef.to(g.device))
        else:
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in local:
                by_kind.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), group in by_kind.items():
                torch._foreach_mul_(group, coef.to(device))
    return total_norm
