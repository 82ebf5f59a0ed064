"""Global gradient norm and clipping for plain, sharded (DTensor) and pipeline-split gradients.

With FSDP/HSDP each rank holds a shard of each gradient as a DTensor; torch's ``get_total_norm``
returns the norm as a DTensor with a pending (Partial) reduction, and ``full_tensor()`` performs the
reduction over exactly the mesh dimensions the gradients are sharded on — replicated copies are not
counted twice. Pipeline stages hold disjoint parameters, so their squared norms are summed over the
pp group (passed in once pipeline parallel lands).

Each tensor's norm is accumulated in float64: torch's fp32 CPU reduction sums squares sequentially and
loses ~1e-5 relative on a 1M-element tensor, which alone would make the measured norm depend on how
the gradients are sharded. The result is returned in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Compute the global L2 norm of all gradients and, if ``max_norm > 0``, scale them to it.

    Args:
        parameters: every parameter of every model part on this rank.
        max_norm: clipping threshold (same units as the gradient norm); <= 0 only measures.
        pp_group: pipeline-parallel group whose ranks hold the other stages' parameters.

    Returns:
        The total norm before clipping, a 0-dim fp32 tensor equal on every rank.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    total_norm = total_norm.float()
    if pp_group is not None:
        squared = total_norm**2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
        total_norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=foreach)
    return total_norm
