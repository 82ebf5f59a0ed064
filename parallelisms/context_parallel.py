"""Context parallel: every sequence is split over the ``cp`` sub-mesh; attention sees all of it.

Activation memory per rank falls by cp because each rank holds seq_len / cp tokens (ring attention:
Liu et al. 2023, arXiv 2310.01889). Two pieces:

- :func:`apply_cp` (at parallelize time) gives each attention module a context-parallel attention
  function bound to the cp group (ring or all-gather, :mod:`parallelisms.ring_attention`).
- :class:`ContextParallel` (at every train step) shards inputs and labels along the sequence and
  swaps each model part's RoPE tables for the rows of this rank's positions, restoring them after.

Causal load balancing ("head-tail"): the sequence is cut into 2·cp chunks and rank i holds chunks
i and 2·cp-1-i, so every rank has the same number of (query, visible key) pairs; without it the
last rank does cp times the attention work of the first.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.checks import ROTATE_METHODS, ContextParallelError, validate_context_parallel  # noqa: F401
from parallelisms.ring_attention import allgather_attention, ring_attention

def cp_positions(seq_len: int, cp: int, load_balance: bool) -> torch.Tensor:
    """LongTensor[cp, seq_len / cp]: the global token positions held by each cp rank.

    Raises:
        ContextParallelError: seq_len not divisible by 2·cp (load-balanced) or cp.
    """
    parts = 2 * cp if load_balance else cp
    if seq_len % parts != 0:
        raise ContextParallelError(
            f"training.seq_len = {seq_len} must be divisible by {'2·cp' if load_balance else 'cp'} = {parts} "
            "for context parallel; change seq_len or parallelism.cp"
            + (" (or set parallelism.cp_load_balance = false)." if load_balance else ".")
        )
    chunks = torch.arange(seq_len).view(parts, seq_len // parts)
    if not load_balance:
        return chunks
    return torch.stack([torch.cat([chunks[i], chunks[parts - 1 - i]]) for i in range(cp)])


def apply_cp(model: nn.Module, context_parallel: "ContextParallel", *, rotate_method: str) -> int:
    """Bind every attention module of ``model`` (those with an ``attention_fn`` slot) to
    context-parallel attention over ``context_parallel``'s cp group and positions; returns how many
    were bound."""
    method = ring_attention if rotate_method == "ring" else allgather_attention
    fn = _CPAttention(method, context_parallel.positions, context_parallel.mesh)
    bound = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = fn
            bound += 1
    return bound


class _CPAttention:
    """Callable ``(q, k, v, documents=None) -> out`` on [B, H, S/cp, head_dim] local blocks, causal
    (block-causal over ``documents``, int [B, S] of the whole window) over the whole sequence."""

    def __init__(self, method, positions: torch.Tensor, cp_mesh: DeviceMesh):
        self.method, self.positions, self.mesh = method, positions, cp_mesh
        # Resolved once: a compiled block then sees a group name and an int, no process-group calls.
        self.group_name, self.rank = cp_mesh.get_group().group_name, cp_mesh.get_local_rank()

    def __call__(self, q, k, v, documents=None):
        positions = self.positions.to(q.device)
        return self.method(q, k, v, positions, self.group_name, documents, rank=self.rank)


class ContextParallel:
    """The cp layout of a run, built once: every rank's token positions (for the attention of
    :func:`apply_cp`) and this rank's per-step sharding of inputs, labels and RoPE tables.

    Args:
        cp_mesh: the cp sub-mesh; seq_len: full sequence length (tokens); load_balance: head-tail split.

    Attributes:
        positions: LongTensor[cp, seq_len / cp], see :func:`cp_positions`; local_positions: this rank's row.
    """

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, load_balance: bool):
        self.mesh = cp_mesh
        self.positions = cp_positions(seq_len, cp_mesh.size(), load_balance)
        self.local_positions = self.positions[cp_mesh.get_local_rank()]

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``tensor`` along ``dim`` (e.g. [B, S] -> [B, S/cp])."""
        return tensor.index_select(dim, self.local_positions.to(tensor.device))

    @contextlib.contextmanager
    def rope_positions(self, model_parts: list[nn.Module]):
        """Within the block, each part's ``rope_cos``/``rope_sin`` rows are this rank's positions, so
        the model applies the right rotation to its local tokens without knowing about CP."""
        saved = []
        for part in model_parts:
            if getattr(part, "rope_cos", None) is not None:
                saved.append((part, part.rope_cos, part.rope_sin))
                index = self.local_positions.to(part.rope_cos.device)
                part.rope_cos = part.rope_cos.index_select(0, index)
                part.rope_sin = part.rope_sin.index_select(0, index)
        try:
            yield
        finally:
            for part, cos, sin in saved:
                part.rope_cos, part.rope_sin = cos, sin
