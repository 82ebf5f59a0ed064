"""Activation checkpointing (recomputation) of transformer blocks.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (arXiv 1604.06174); selective per-op
recomputation after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198): keep the outputs of the expensive ops (matmuls, attention) and recompute
the cheap element-wise ones (norms, activations), which saves most activation memory for little
extra compute. The per-op policies run through torch.utils.checkpoint's selective checkpointing
(``create_selective_checkpoint_contexts``: a policy decides, op by op, to save or recompute).

Modes (``[activation_checkpoint]``):
- ``none``: keep every activation.
- ``full``: keep only each block's input; recompute the whole block in backward.
- ``selective`` with ``selective_ac_option = "N"``: full recomputation of every N-th block.
- ``selective`` with ``selective_ac_option = "op"`` (TorchTitan's per-op policy): in every block,
  keep the outputs of attention (the SDPA kernels; also context parallel's all-gather method, which
  calls SDPA), under tensor parallel the reduce-scatter outputs, and of the matrix multiplies all
  but every second one (the 2nd, 4th, ... ``mm`` of each block forward are recomputed: for a LLaMA
  block wk, wo and w3); recompute the rest. The counter restarts at every block forward; torch
  replays the forward's decisions by index in the recomputation (torch/utils/checkpoint.py
  ``_CachedTorchDispatchMode``), and a torch that asks the policy again there gets a counter of its
  own (``ctx.is_recompute``), so forward and recomputation decide alike. Context parallel's ring
  attention is one custom operator (parallelisms/ring_attention.py), kept like SDPA's kernels:
  its K/V exchange does not run again in the recomputation.
- ``selective`` with ``selective_ac_option = "op_all_matmuls"``: the same, keeping every matmul
  output (``mm``, ``addmm``, ``bmm``): only the element-wise ops and all-gathers are recomputed. It
  keeps about a third more per block than "op" (engine/planner/activations.py) and recomputes no
  matmul: use it when the model fits with it and the recomputed matmuls' time matters.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import parallelisms.ring_attention  # noqa: F401  (registers quadra::ring_attention, kept by the policies)

_MODES = ("none", "full", "selective")
OP_OPTIONS = ("op", "op_all_matmuls")  # the per-op policies (module docstring)


def _op(namespace: str, name: str):
    """torch.ops.<namespace>.<name>.default, or None where this build lacks it."""
    packet = getattr(getattr(torch.ops, namespace), name, None)
    return getattr(packet, "default", None) if packet is not None else None


# Outputs always kept by both per-op policies: attention and tensor parallel's reduce-scatter.
_ATTENTION_OPS = {
    _op("aten", "_scaled_dot_product_efficient_attention"),
    _op("aten", "_scaled_dot_product_flash_attention"),
    _op("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    _op("aten", "_scaled_dot_product_cudnn_attention"),
    _op("_c10d_functional", "reduce_scatter_tensor"),
    _op("quadra", "ring_attention"),  # registered by parallelisms/ring_attention.py, imported above
} - {None}
# The matmuls "op" counts; every second one of a block forward is recomputed.
# torch._scaled_mm: a float8 linear's matmul (torchao's Float8Linear, parallelisms/float8.py).
COUNTED_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, _op("aten", "_scaled_mm")} - {None}
# "op_all_matmuls" keeps these too (bmm: batched matmuls, e.g. plain-matmul attention).
_ALL_MATMULS = COUNTED_MATMULS | {torch.ops.aten.bmm.default}


def always_saved_ops() -> set:
    """The ops whose outputs both per-op policies keep: attention and TP's reduce-scatter."""
    return set(_ATTENTION_OPS)


def _every_second_matmul_policy(saved_ops: set, counts: Counter, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """TorchTitan's "op": save ``saved_ops`` and the odd-numbered matmuls of this block forward.

    ``counts`` belongs to one block forward (a fresh one per checkpointed call, :func:`_op_context`),
    keyed by forward / recompute so the recomputation counts from 1 again and decides the same way.
    """
    if op in COUNTED_MATMULS:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _all_matmuls_policy(saved_ops: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """"op_all_matmuls": save every matmul output and ``saved_ops``; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in saved_ops or op in _ALL_MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context(option: str):
    """The (forward, recompute) contexts of one checkpointed block call under per-op ``option``."""
    saved = always_saved_ops()
    if option == "op":
        policy = partial(_every_second_matmul_policy, saved, Counter())
    else:
        policy = partial(_all_matmuls_policy, saved)
    return create_selective_checkpoint_contexts(policy)


def parse_ac_option(mode: str, selective_ac_option: str) -> int | str | None:
    """Validate the two settings; returns None (off), 1 (full), N (every N-th block), "op" or
    "op_all_matmuls".

    Raises:
        ValueError: an unknown mode, or a selective option that is neither one of :data:`OP_OPTIONS`
            nor an int >= 1.
    """
    if mode not in _MODES:
        raise ValueError(f"activation_checkpoint.mode = {mode!r}: choose one of {', '.join(_MODES)}.")
    if mode == "none":
        return None
    if mode == "full":
        return 1
    if selective_ac_option in OP_OPTIONS:
        return selective_ac_option
    try:
        every = int(selective_ac_option)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(
            f"activation_checkpoint.selective_ac_option = {selective_ac_option!r}: use \"op\", "
            "\"op_all_matmuls\" or a positive integer N (checkpoint every N-th block)."
        )
    return every


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_ac_option: str) -> int:
    """Wrap blocks of ``model.layers`` in place; returns the number of blocks wrapped.

    Wrapped blocks keep their ``ModuleDict`` key, and ``checkpoint_wrapper`` strips its own prefix
    from state-dict keys, so checkpoints do not depend on this setting.
    """
    option = parse_ac_option(mode, selective_ac_option)
    if option is None:
        return 0
    wrapped = 0
    for index, (name, block) in enumerate(list(model.layers.items())):
        if option in OP_OPTIONS:
            model.layers[name] = checkpoint_wrapper(
                block, context_fn=partial(_op_context, option), preserve_rng_state=False
            )
        elif index % option == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        wrapped += 1
    return wrapped
