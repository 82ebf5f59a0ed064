"""Expert parallel: experts spread over the ``ep`` ranks, tokens moved to them by all-to-all.

GShard (arXiv 2006.16668, §2.2) and Switch Transformer (arXiv 2101.03961): each of the ``ep`` ranks
holds ``E / ep`` of a layer's experts (rank r holds experts [r·E/ep, (r+1)·E/ep)). Every rank routes
its own tokens, then

1. dispatch: the token copies, already grouped by expert (so by destination rank), go to the ranks
   holding their experts with one ``all_to_all_single`` with uneven splits; the per-expert counts
   are exchanged first so every rank knows how many rows it receives;
2. the received rows, ordered [source rank][local expert], are regrouped to [local expert][source
   rank] so each local expert sees one contiguous group, and the local experts run;
3. combine: the inverse regroup and the inverse all-to-all bring every output row back to the
   rank and position it came from.

Both all-to-alls are autograd-aware (``_functional_collectives.all_to_all_single_autograd``): the
backward of a dispatch is the matching combine of the gradients and vice versa, so expert weights
receive the gradient of every token routed to them from any rank, and no rank skips a collective
even when it sends or receives nothing.

This file is model-agnostic: :class:`ExpertParallel` is a ``ParallelStyle`` for any module whose
forward is ``(x [N, dim] grouped by expert, counts [E]) -> [N, dim]`` and whose parameters are
stacked per expert on dim 0. The regroup index is a pure function (:func:`regroup_by_local_expert`).
:func:`shard_experts` is the experts' own FSDP over the ranks left after ep, which the shared driver
(parallelisms/parallelize.py) runs in its FSDP step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from parallelisms.checks import ExpertParallelError, validate_expert_parallel  # start-up rules, torch-free
from parallelisms.data_parallel import mixed_precision_policy, reshard_setting, shard_module

__all__ = ["ExpertParallel", "ExpertParallelError", "regroup_by_local_expert", "shard_experts",
           "validate_expert_parallel"]


def regroup_by_local_expert(counts: torch.Tensor) -> torch.Tensor:
    """Row index that reorders received rows from [source][expert] to [expert][source] blocks.

    Args:
        counts: LongTensor [ep, E_local]: rows received from each source rank for each local
            expert, in the order they arrive (source-major).
    Returns:
        LongTensor [counts.sum()]: ``received[index]`` has each local expert's rows contiguous
        (sources in rank order, each source's rows in their sent order). ``index`` is a
        permutation, so ``out[index] = y`` undoes it.
    """
    flat = counts.reshape(-1)
    start = torch.cumsum(flat, 0) - flat  # where block (source, expert) begins in the received rows
    by_expert = torch.arange(flat.numel(), device=counts.device).view(counts.shape).t().reshape(-1)
    block_sizes = flat[by_expert]
    block_begin = torch.cumsum(block_sizes, 0) - block_sizes  # where it begins after regrouping
    total = int(flat.sum())
    offset_in_block = torch.arange(total, device=counts.device) - torch.repeat_interleave(block_begin, block_sizes)
    return torch.repeat_interleave(start[by_expert], block_sizes) + offset_in_block


class ExpertParallel(ParallelStyle):
    """Shard an experts module over a 1-D ``ep`` mesh and wrap its forward in all-to-all hooks.

    Parameters become DTensors ``Shard(0)`` on the ep mesh (each rank initializes and updates only
    its experts); the module's forward then sees local rows and local weights. FSDP may shard those
    DTensors again over the remaining data-parallel ranks (FSDP2 builds the 2-D mesh).

    The dispatch hook keeps the splits of the current forward on this object until the combine
    hook of the same forward; the autograd functions keep their own copies for backward, so
    several microbatches in flight (pipeline schedules) and activation-checkpoint recomputation
    are safe.
    """

    def __init__(self) -> None:
        super().__init__()
        self._state: tuple[list[int], list[int], torch.Tensor] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ExpertParallelError(f"ExpertParallel needs a 1-D ep mesh, got {device_mesh.ndim} dims")
        return distribute_module(
            module, device_mesh, partition_fn=self._partition, input_fn=self._dispatch, output_fn=self._combine
        )

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            # src_data_rank=None: no scatter (the parameters are on the meta device or will be
            # initialized per rank from the same seeded full tensor).
            sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [N, dim] grouped by global expert, counts [E]) -> (rows for the local experts
        [M, dim] grouped by local expert, their counts [E_local])."""
        x, counts = inputs
        ep = mesh.size()
        group = mesh.get_group()
        # How many rows every rank will send to each of this rank's experts: [source, local expert].
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
        recv_counts = recv_counts.view(ep, -1)
        input_splits = counts.view(ep, -1).sum(dim=1).tolist()
        output_splits = recv_counts.sum(dim=1).tolist()
        # wait_tensor, not .wait(): the latter returns a view, which FSDP's output hooks warn about.
        received = wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))
        index = regroup_by_local_expert(recv_counts)
        self._state = (input_splits, output_splits, index)
        return received.index_select(0, index), recv_counts.sum(dim=0)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Local experts' output [M, dim] -> rows back on their source ranks, in sent order [N, dim]."""
        if self._state is None:
            raise RuntimeError("ExpertParallel combine without a dispatch in the same forward")
        input_splits, output_splits, index = self._state
        self._state = None
        source_order = out.new_empty(out.shape).index_copy(0, index, out)
        return wait_tensor(all_to_all_single_autograd(source_order, input_splits, output_splits, mesh.get_group()))


def shard_experts(experts: list[nn.Module], parallel_dims, *, param_dtype: str, reduce_dtype: str,
                  reshard_after_forward: str, backend: str) -> None:
    """FSDP (HSDP with dp_replicate) of expert-parallel ``experts`` modules over the ranks left after ep.

    An expert's weights live on one ep rank of each group, so they are sharded, and their gradients
    summed, only over the ranks holding the same experts: the ``dp_shard_mod_ep`` mesh (with
    ``dp_replicate``: ``ep_hsdp``). Gradients come out exact, not ep times too large: the all-to-all
    backward brings each expert the gradient of every token routed to it, and FSDP *sums* over the
    other groups (parallelisms/data_parallel.py). Run just before the blocks are sharded, so their
    FSDP units skip these weights.

    Args:
        experts: the ``experts`` module of each MoE layer, already ``ExpertParallel`` (weights
            ``Shard(0)`` on the ep mesh, stacked per expert on dim 0).
        parallel_dims: the ``ParallelDims`` with its mesh built.
        param_dtype, reduce_dtype: ``training.mixed_precision_param`` / ``_reduce``.
        reshard_after_forward: ``parallelism.fsdp_reshard_after_forward`` (see
            ``parallelisms.data_parallel.reshard_setting``).
        backend: process-group backend ("gloo", "nccl").
    """
    mesh = parallel_dims.mesh("ep_hsdp" if parallel_dims.dp_replicate_enabled else "dp_shard_mod_ep")
    shard_size = parallel_dims.mesh("dp_shard_mod_ep").size()
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    # As for the blocks ("default": free after forward, but keep them across microbatches under PP).
    reshard = reshard_setting(reshard_after_forward, parallel_dims.pp_enabled) != "never"
    for module in experts:
        local_experts = module.w1.to_local().shape[0]

        def placement(param, _local=local_experts):
            # Fewer local experts than shards: shard inside each expert (dim 1) so no rank is empty.
            if _local % shard_size != 0 and param.shape[1] % shard_size == 0:
                return Shard(1)
            return Shard(0)

        shard_module(module, mesh, policy, reshard=reshard, backend=backend, shard_placement_fn=placement)
