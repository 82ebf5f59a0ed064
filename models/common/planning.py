"""What the layout planner knows of a model, torch-free: each parameter's shape and placement.

A family lists its parameters as :class:`ParamSpec` (``ModelSpec.param_shapes``) and, when it routes
tokens to experts, describes the routing as :class:`ExpertRouting` (``ModelSpec.expert_routing``);
engine/planner/ turns them into per-rank bytes, communication and FLOPs without knowing the family.
Placements follow the family's parallelize plan (e.g. models/common/parallelize.py): ``tp_dim`` is
the dim tensor parallel shards (0 for column-parallel ``Shard(0)`` of an [out, in] weight, 1 for
row-parallel), ``expert`` marks routed-expert tensors [E, ...] sharded over ep on dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ParamSpec", "ExpertRouting", "AttentionActivations", "gqa_attention_activations"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``name`` (as in ``named_parameters``), global ``shape``, ``layer`` (block index;
    None for the embedding, final norm and output), ``tp_dim`` (dim sharded over tp; None when
    replicated), ``expert`` (a routed-experts tensor [E, ...], sharded over ep when ep > 1),
    ``norm`` (an RMSNorm weight: a replicated DTensor under sequence parallel), ``on_last_stage``
    (a first-stage parameter the last pipeline stage holds a copy of, beside its output head:
    parallelisms/pipeline_tied.py)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    tp_dim: int | None = None
    expert: bool = False
    norm: bool = False
    on_last_stage: bool = False

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


@dataclass(frozen=True)
class AttentionActivations:
    """What one attention layer keeps for backward, per token, beyond its input norm's input and
    output (engine/planner/activations.py counts those, the feed-forward and the loss).

    Attributes:
        heads: attention heads H (split over tp); the kernel's log-sum-exp is fp32 [H] per token.
        qk_head_dim, v_head_dim: one head's query/key and value widths as the attention kernel sees
            them. torch's fused CPU SDPA kernel needs them equal; else SDPA's math path keeps the
            softmax probabilities [H, s] per token instead of the output and log-sum-exp.
        split: elements per token kept that tensor parallel splits with the heads, besides the
            kernel's output: q, k, v as the kernel receives them, the output's [H·v_head_dim] copy
            for wo, QK-norm's tensors.
        replicated: elements per token kept on every tp rank (MLA's latents, their RMSNorm's
            normalized tensor, output and rstd).
        matmuls: (output width, input width, output split over tp) per token of each attention
            matmul in forward order, wo last (a full-width partial sum under TP): what the per-op AC
            policies choose from and recompute.
        backward: elements per token, split over tp, of the gradients alive in the attention's
            backward (the math path's [H, s] gradients are added by the planner).
    """

    heads: int
    qk_head_dim: int
    v_head_dim: int
    split: int
    replicated: int
    matmuls: tuple[tuple[int, int, bool], ...]
    backward: int


def gqa_attention_activations(args) -> AttentionActivations:
    """LLaMA's attention (grouped keys and values repeated to every query head, optional QK-norm) as
    :class:`AttentionActivations`: q, k, v at d = n_heads·head_dim, the output's copy for wo (4d),
    with QK-norm each norm's input and normalized q, k (2(d + kv)); matmuls wq, wk, wv (d, kv, kv)
    and wo (dim, from d); five d-wide gradients in backward. Reads ``n_heads``, ``head_dim``, ``kv_heads``,
    ``dim`` and ``qk_norm`` (absent = off)."""
    d, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    qk_norm = 2 * (d + kv) if getattr(args, "qk_norm", False) else 0
    return AttentionActivations(heads=args.n_heads, qk_head_dim=args.head_dim, v_head_dim=args.head_dim,
                                split=4 * d + qk_norm, replicated=0,
                                matmuls=((d, args.dim, True), (kv, args.dim, True), (kv, args.dim, True),
                                         (args.dim, d, False)), backward=5 * d)


@dataclass(frozen=True)
class FeedForwardActivations:
    """What one block's feed-forward keeps for backward, per token.

    Attributes:
        width: SwiGLU hidden width f (four [f] tensors kept: w1·x, silu(w1·x), w3·x, their product;
            MoE: top_k routed copies plus the shared experts), split over tp.
        routed: further elements kept on every rank by routing (the token's routed copies at the
            experts' input, output and weighted sum, router scores, indices); 0 for a dense one.
    """

    width: int
    routed: int = 0
