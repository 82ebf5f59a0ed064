"""The MoE family as the layout planner sees it (torch-free): parameters, FLOPs, width, routing.

Placements follow models/common/moe_parallelize.py: routed experts [E, dim, hidden] / [E, hidden, dim]
(models/common/moe.py ``GroupedExperts``) ``Shard(0)`` over the ``ep`` mesh and FSDP-sharded over the
remaining ``dp_shard·cp/ep`` ranks; the router gate and, without ep, the experts replicated on tp;
shared experts column/row-parallel like the dense feed-forward.
"""

from __future__ import annotations

from models.common.shapes import dense_feed_forward, training_flops_per_token, transformer_param_shapes
from models.common.planning import ExpertRouting, ParamSpec

__all__ = ["moe_feed_forward", "moe_param_shapes", "moe_flops_per_token", "moe_ffn_width", "moe_routing"]


def moe_feed_forward(args, layer: int, p: str) -> list[ParamSpec]:
    """Block ``layer``'s feed-forward: the dense SwiGLU before ``n_dense_layers``, else the router gate
    [E, dim], the routed experts [E, dim, hidden] / [E, hidden, dim] and the fused shared experts."""
    if not args.is_moe_layer(layer):
        return dense_feed_forward(args, layer, p)
    e, h, dim = args.num_experts, args.moe_inter_dim, args.dim
    params = [
        ParamSpec(p + "feed_forward.router.gate.weight", (e, dim), layer),
        ParamSpec(p + "feed_forward.experts.w1", (e, dim, h), layer, expert=True),
        ParamSpec(p + "feed_forward.experts.w2", (e, h, dim), layer, expert=True),
        ParamSpec(p + "feed_forward.experts.w3", (e, dim, h), layer, expert=True),
    ]
    if args.n_shared_experts > 0:
        hs = h * args.n_shared_experts
        params += [
            ParamSpec(p + "feed_forward.shared_experts.w1.weight", (hs, dim), layer, tp_dim=0),
            ParamSpec(p + "feed_forward.shared_experts.w2.weight", (dim, hs), layer, tp_dim=1),
            ParamSpec(p + "feed_forward.shared_experts.w3.weight", (hs, dim), layer, tp_dim=0),
        ]
    return params


def moe_param_shapes(args) -> list[ParamSpec]:
    """``ModelSpec.param_shapes`` of the MoE family (``MoEModelArgs``)."""
    return transformer_param_shapes(args, moe_feed_forward)


def moe_flops_per_token(args, seq_len: int) -> float:
    """``ModelSpec.flops_per_token`` of an MoE decoder: :func:`training_flops_per_token` with the routed
    experts at the top_k / num_experts share a token runs through (active parameters)."""
    return training_flops_per_token(moe_param_shapes(args), seq_len, blocks=args.n_layers, heads=args.n_heads,
                                    qk_head_dim=args.head_dim, v_head_dim=args.head_dim,
                                    tie_embeddings=args.tie_embeddings, expert_share=args.top_k / args.num_experts)


def moe_ffn_width(args) -> int:
    """Hidden width a token's feed-forward activations have: top_k routed copies plus the shared
    experts (applied to every block, dense ones included: an upper bound for those)."""
    return args.top_k * args.moe_inter_dim + args.n_shared_experts * args.moe_inter_dim


def moe_routing(args) -> ExpertRouting:
    """``ModelSpec.expert_routing`` of the MoE family."""
    return ExpertRouting(args.num_experts, args.top_k,
                         frozenset(i for i in range(args.n_layers) if args.is_moe_layer(i)))
