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

This file is model-agnostic: which module gets which style is the model's plan
(``models/<name>/parallelize.py``). The helpers here apply a plan over the ``tp`` sub-mesh, give the
loss-parallel context, enable async TP, and check the settings at start-up.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

__all__ = [
    "TensorParallelError",
    "apply_tensor_parallel",
    "enable_async_tp",
    "loss_parallel_context",
    "to_local",
    "validate_tensor_parallel",
    "wait_async_output",
]


class TensorParallelError(ValueError):
    """A ``[parallelism]`` tensor-parallel setting that cannot work with this model or run."""


def validate_tensor_parallel(
    parallelism_cfg,
    *,
    divisible: dict[str, int],
    vocab_size: int,
    seq_len: int,
    device_type: str,
    compile_enabled: bool,
) -> None:
    """Check the tensor-parallel settings before anything is built; raises the same error on every rank.

    Args:
        parallelism_cfg: ``[parallelism]`` (tp, sequence_parallel, loss_parallel, async_tp).
        divisible: model sizes that the plan shards over tp, by the name the user knows them by
            (e.g. ``{"dim": 256, "n_heads": 16}``); each must be a multiple of tp.
        vocab_size: rows of the embedding / output projection (tokens); the plan shards them over tp.
        seq_len: tokens per sequence (``training.seq_len``); sequence parallel shards it over tp.
        device_type: "cuda" or "cpu"; compile_enabled: ``compile.enable``.

    Raises:
        TensorParallelError: naming the setting, its value and the fix, for: a size in ``divisible``
            or ``vocab_size`` not divisible by tp, ``seq_len % tp != 0`` with sequence parallel,
            ``async_tp`` with tp = 1, without sequence parallel, without CUDA or without compile.
    """
    cfg = parallelism_cfg
    tp = cfg.tp
    if cfg.async_tp:
        # Async TP overlaps the sequence-parallel all-gather / reduce-scatter with the matmuls: it
        # is an inductor pass over CUDA symmetric-memory collectives, so it needs all of these.
        missing = []
        if tp <= 1:
            missing.append(f"parallelism.tp > 1 (it is {tp})")
        if not cfg.sequence_parallel:
            missing.append("parallelism.sequence_parallel = true (its collectives are what it overlaps)")
        if device_type != "cuda":
            missing.append(f"CUDA devices (this run uses {device_type})")
        if not compile_enabled:
            missing.append("compile.enable = true (the overlap is a torch.compile pass)")
        if missing:
            raise TensorParallelError(
                "parallelism.async_tp = true needs " + ", ".join(missing)
                + ". Set parallelism.async_tp = false, or meet those conditions."
            )
    if tp <= 1:
        return
    for name, size in divisible.items():
        if size % tp != 0:
            raise TensorParallelError(
                f"parallelism.tp = {tp} does not divide the model's {name} = {size}: tensor parallel "
                f"gives every rank {name} / tp of it. Choose a tp that divides {size}, or another flavor."
            )
    if vocab_size % tp != 0:
        padded = -(-vocab_size // tp) * tp
        raise TensorParallelError(
            f"parallelism.tp = {tp} does not divide the vocabulary size {vocab_size}: the embedding and "
            "the output projection (and, with parallelism.loss_parallel, the logits) are sharded over "
            f"the vocabulary. Pad it: set model.vocab_size = {padded} (ids the tokenizer never emits "
            "are harmless), or choose a tp that divides it."
        )
    if cfg.sequence_parallel and seq_len % tp != 0:
        raise TensorParallelError(
            f"training.seq_len = {seq_len} is not divisible by parallelism.tp = {tp}: sequence parallel "
            "gives every rank seq_len / tp tokens of each sequence. Choose a seq_len that is a multiple "
            "of tp, or set parallelism.sequence_parallel = false."
        )


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following ``plan``.

    A thin wrapper over :func:`torch.distributed.tensor.parallel.parallelize_module`, kept so that
    every model applies TP the same way (and so that the mesh check is in one place).

    Args:
        module: a model or one of its sub-modules (parameters may be on the meta device).
        tp_mesh: the ``tp`` sub-mesh (1-D).
        plan: fully-qualified sub-module name (relative to ``module``) -> parallel style.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallel needs a 1-D tp mesh, got {tp_mesh.ndim} dims {tp_mesh.mesh_dim_names}")
    return parallelize_module(module, tp_mesh, plan)


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
