"""Activation checkpointing (recomputation) of transformer blocks.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (arXiv 1604.06174); selective per-op
recomputation after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198): keep the outputs of the expensive ops (matmuls, attention) and recompute
the cheap element-wise ones (norms, activations), which saves most activation memory for little
extra compute.

Modes (``[activation_checkpoint]``):
- ``none``: keep every activation.
- ``full``: keep only each block's input; recompute the whole block in backward.
- ``selective`` with ``selective_ac_option = "N"``: full recomputation of every N-th block.
- ``selective`` with ``selective_ac_option = "op"``: every block, recompute all but the saved ops.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_MODES = ("none", "full", "selective")

# Outputs of these ops are saved under per-op selective checkpointing; everything else is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def parse_ac_option(mode: str, selective_ac_option: str) -> int | str | None:
    """Validate the two settings; returns None (off), 1 (full), N (every N-th block) or "op".

    Raises:
        ValueError: an unknown mode, or a selective option that is neither "op" nor an int >= 1.
    """
    if mode not in _MODES:
        raise ValueError(f"activation_checkpoint.mode = {mode!r}: choose one of {', '.join(_MODES)}.")
    if mode == "none":
        return None
    if mode == "full":
        return 1
    if selective_ac_option == "op":
        return "op"
    try:
        every = int(selective_ac_option)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(
            f"activation_checkpoint.selective_ac_option = {selective_ac_option!r}: use \"op\" or a "
            "positive integer N (checkpoint every N-th block)."
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
        if option == "op":
            model.layers[name] = checkpoint_wrapper(
                block, context_fn=partial(_op_context), preserve_rng_state=False
            )
        elif index % option == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        wrapped += 1
    return wrapped
