"""What the layout planner knows of a model, torch-free: each parameter's shape and placement.

A family lists its parameters as :class:`ParamSpec` (``ModelSpec.param_shapes``) and, when it routes
tokens to experts, describes the routing as :class:`ExpertRouting` (``ModelSpec.expert_routing``);
engine/planner/ turns them into per-rank bytes, communication and FLOPs without knowing the family.
Placements follow the family's parallelize plan (e.g. models/llama/parallelize.py): ``tp_dim`` is
the dim tensor parallel shards (0 for column-parallel ``Shard(0)`` of an [out, in] weight, 1 for
row-parallel), ``expert`` marks routed-expert tensors [E, ...] sharded over ep on dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ParamSpec", "ExpertRouting"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``name`` (as in ``named_parameters``), global ``shape``, ``layer`` (block index;
    None for the embedding, final norm and output), ``tp_dim`` (dim sharded over tp; None when
    replicated), ``expert`` (a routed-experts tensor [E, ...], sharded over ep when ep > 1),
    ``norm`` (an RMSNorm weight: a replicated DTensor under sequence parallel)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    tp_dim: int | None = None
    expert: bool = False
    norm: bool = False

    @property
    def numel(self) -> int:
        """Elements of the whole (unsharded) parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExpertRouting:
    """How a mixture-of-experts model routes tokens, for the planner's ep communication and width.

    Attributes:
        num_experts: routed experts per MoE layer (E); top_k: experts each token is sent to.
        moe_layers: the block indices that route (the others are dense).
    """

    num_experts: int
    top_k: int
    moe_layers: frozenset[int]
