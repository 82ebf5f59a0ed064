"""Tensor parallel (Megatron-LM intra-layer split) through ``torch.distributed.tensor.parallel``.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) splits each transformer sub-block over the
``tp`` ranks: the first linear layer column-parallel (each rank computes a slice of the output
features, e.g. its share of the attention heads), the second row-parallel (each rank multiplies its
slice of the input features and the partial results are summed). A sub-block then needs one
all-reduce in forward (after the row-parallel layer) and one in backward (before the column-parallel
layer). Sequence parallel (Korthikanti et al. 2022, arXiv 2205.05198) also splits the sequence dim
of the activations between sub-blocks over the same ranks: the norms run on sequence shards, and
each all-reduce becomes an all-gather (before the column-parallel layer) plus a reduce-scatter
(after the row-parallel layer), the same bytes but 1/tp of the activation memory outside the
sub-blocks. Loss parallel computes the cross entropy on vocab-sharded logits, so the full
[tokens, vocab] logits never exist on one rank.

This file is model-agnostic: which module gets which style is the family's plan, data built by
``models/<name>/parallelize.py`` (:data:`TensorParallelPlan`), which the shared driver
(parallelisms/parallelize.py) hands to :func:`apply_tp_plan`. The helpers here apply a plan over the
``tp`` sub-mesh, give the loss-parallel context, enable async TP, and check the settings at start-up.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from parallelisms.checks import TensorParallelError, validate_tensor_parallel  # start-up rules, torch-free

__all__ = [
    "ReplicateOnTP",
    "TensorParallelError",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "apply_tp_plan",
    "enable_async_tp",
    "loss_parallel_context",
    "to_local",
    "validate_tensor_parallel",
    "wait_async_output",
]





def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: ParallelStyle | dict[str, ParallelStyle]
) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following ``plan``.

    A thin wrapper over :func:`torch.distributed.tensor.parallel.parallelize_module`, kept so that
    every model applies TP the same way (and so that the mesh check is in one place).

    Args:
        module: a model or one of its sub-modules (parameters may be on the meta device).
        tp_mesh: the ``tp`` sub-mesh (1-D).
        plan: a parallel style for ``module`` itself, or fully-qualified sub-module name (relative to
            ``module``) -> parallel style.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallel needs a 1-D tp mesh, got {tp_mesh.ndim} dims {tp_mesh.mesh_dim_names}")
    return parallelize_module(module, tp_mesh, plan)


# A family's tensor-parallel plan, as data: (module, style or {sub-module name: style}) pairs,
# applied in order (models/<family>/parallelize.py build it from the model they are given).
TensorParallelPlan = list[tuple[nn.Module, ParallelStyle | dict[str, ParallelStyle]]]


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """Apply a family's tensor-parallel ``plan`` to ``model`` (a whole model or a pipeline stage).

    Each pair goes through :func:`apply_tensor_parallel` in order. Parameters the model shares
    between modules (tied embeddings: ``output.weight is tok_embeddings.weight``) stay shared:
    ``parallelize_module`` distributes each module's weight separately, so afterwards every other
    name of a shared parameter is pointed at the DTensor of its first name (in
    ``named_parameters`` order); the plan must give both the same placement (e.g. both sharded on
    the vocab dim).

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    shared = _shared_parameter_names(model)
    for module, style in plan:
        apply_tensor_parallel(module, tp_mesh, style)
    for first, *others in shared:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that ``model`` holds under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class VocabParallelEmbedding(ParallelStyle):
    """Row-parallel ``nn.Embedding`` whose weight gradient stays a vocab shard (Megatron-LM's
    ``VocabParallelEmbedding``, arXiv 1909.08053 §3).

    The weight becomes a ``Shard(0)`` DTensor on the tp mesh: each of the ``tp`` ranks owns
    ``vocab_size / tp`` consecutive rows. Forward, per rank: ids outside its rows are masked, the
    others are looked up in the local ``[vocab/tp, dim]`` shard, masked positions are zeroed, and
    the partial ``[B, S, dim]`` embeddings are summed over tp into ``output_layouts`` (an all-reduce
    for ``Replicate()``, a reduce-scatter onto sequence shards for ``Shard(1)``); the module returns
    the local tensor (``[B, S, dim]`` or ``[B, S/tp, dim]``).

    Why not torch's ``RowwiseParallel`` on the embedding: its DTensor backward (torch 2.13) has no
    vocab-sharded rule for ``embedding_dense_backward``, so the weight gradient comes out as a
    *replicated* ``[vocab, dim]`` tensor on every rank (for Llama-3 8B at tp 8, 2.1 GB of fp32 instead
    of 263 MB) and every rank does the whole embedding backward. Here the lookup runs on the local
    shard, so its gradient is the local ``[vocab/tp, dim]`` shard, with the parameter's placement.

    Args:
        output_layouts: placement of the summed embeddings on the tp mesh: ``Replicate()`` or
            ``Shard(1)`` (sequence parallel).

    Raises:
        ValueError: the module is not an ``nn.Embedding``, uses ``padding_idx``/``max_norm``/sparse
            gradients, or its rows do not split evenly over the mesh.
    """

    def __init__(self, *, output_layouts: Placement = Replicate()):
        super().__init__()
        self.output_layouts = output_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"VocabParallelEmbedding applies to nn.Embedding, got {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError("VocabParallelEmbedding supports neither padding_idx, max_norm nor sparse gradients")
        if module.num_embeddings % device_mesh.size() != 0:
            raise ValueError(f"{module.num_embeddings} embedding rows do not split evenly "
                             f"over tp = {device_mesh.size()}")

        def shard_rows(_name, mod, mesh):
            mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, partition_fn=shard_rows)
        output_layout = self.output_layouts

        def forward(mod: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            # mod.weight is read at call time: FSDP swaps in its unsharded DTensor before forward.
            shard = mod.weight.to_local()  # [vocab / tp, dim]; its gradient returns as Shard(0)
            rows = shard.shape[0]
            start = device_mesh.get_local_rank() * rows
            outside = (ids < start) | (ids >= start + rows)
            local = F.embedding((ids - start).masked_fill(outside, 0), shard)
            local = local.masked_fill(outside.unsqueeze(-1), 0.0)
            summed = DTensor.from_local(local, device_mesh, [Partial()], run_check=False)
            return summed.redistribute(device_mesh, [output_layout]).to_local()

        module.forward = types.MethodType(forward, module)
        return module


class ReplicateOnTP(ParallelStyle):
    """Parameters become Replicate DTensors on the tp mesh; the module computes on local tensors.

    For modules that every tp rank runs on the same tokens (e.g. an MoE router): their gradients
    are then equal on every tp rank (Replicate is their true placement) and nothing is
    communicated. DTensors rather than plain tensors so that gradient clipping and the optimizer's
    foreach kernels see one kind of tensor next to tensor parallel's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

        def to_local_output(_, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local_output)


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the logits are vocab-sharded DTensors, else a no-op context.

    Forward cross entropy *and* its backward must run inside it: both replace the softmax over the
    vocab dim by local computations plus small all-reduces (max, sum of exponentials, target logit).
    ``reduction="sum"`` is supported on the tp mesh and returns a Replicate DTensor holding the
    full sum on every tp rank.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


def to_local(tensor):
    """The local value of a Replicate DTensor (e.g. a loss-parallel loss); other tensors as they are.

    Raises:
        ValueError: a DTensor that is not replicated on every mesh dim (its local value would be a
            shard or a partial sum, not the value).
    """
    if not isinstance(tensor, DTensor):
        return tensor
    if not all(p.is_replicate() for p in tensor.placements):
        raise ValueError(f"expected a replicated DTensor, got placements {tensor.placements}")
    return tensor.to_local()


def wait_async_output(module: nn.Module) -> None:
    """Make ``module`` return a plain tensor instead of an un-awaited async collective result.

    TP styles redistribute their outputs asynchronously: with ``use_local_output`` the module
    returns an ``AsyncCollectiveTensor`` that waits on first use. Handed as an input to a
    ``torch.compile``'d block, it breaks backward in torch 2.13 (DTensor's redistribute backward
    receives a plain gradient: "'Tensor' object has no attribute '_local_tensor'"). One element-wise
    op outside the compiled region waits for the collective and keeps autograd connected; it costs a
    copy of the output (e.g. the [B, S/tp, dim] embedding), so apply it only in front of compiled code.
    """

    def _materialize(_module, _inputs, output):
        return output.clone()

    module.register_forward_hook(_materialize)


def enable_async_tp() -> None:
    """Turn on inductor's micro-pipelined TP (async TP) for the compiled blocks.

    Call after :func:`validate_tensor_parallel` accepted ``async_tp`` (CUDA, compile, sequence
    parallel). Inductor then splits each all-gather → matmul and matmul → reduce-scatter pair into
    chunks that overlap communication with compute over CUDA symmetric memory. torch 2.13 needs no
    explicit registration of the tp group for symmetric memory (``enable_symm_mem_for_group`` is
    deprecated), so the flag is all there is to set.
    """
    from torch._inductor import config as inductor_config

    # A process-wide inductor flag: it applies to every compiled graph that holds TP collectives.
    inductor_config._micro_pipeline_tp = True
