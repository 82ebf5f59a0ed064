"""The MoE family as the layout planner sees it (torch-free): parameters, FLOPs, width, routing.

Placements follow models/common/moe_parallelize.py: routed experts [E, dim, hidden] / [E, hidden, dim]
(models/common/moe.py ``GroupedExperts``) ``Shard(0)`` over the ``ep`` mesh and FSDP-sharded over the
remaining ``dp_shard·cp/ep`` ranks; the router gate and, without ep, the experts replicated on tp;
shared experts column/row-parallel like the dense feed-forward.
"""

from __future__ import annotations

from models.common.shapes import attention_flops_per_token, dense_feed_forward, transformer_param_shapes
from models.common.planning import ExpertRouting, ParamSpec

__all__ = ["moe_param_shapes", "moe_flops_per_token", "moe_ffn_width", "moe_routing"]


def _moe_feed_forward(args, layer: int, p: str) -> list[ParamSpec]:
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
    return transformer_param_shapes(args, _moe_feed_forward)


def moe_flops_per_token(args, seq_len: int) -> float:
    """6N + attention per token with N the *active* parameters: of the routed experts only the
    top_k / num_experts share a token runs through (``MoEModelArgs.get_nparams_and_flops``)."""
    n = 0.0
    for p in moe_param_shapes(args):
        if p.name.startswith("tok_embeddings") and not args.tie_embeddings:
            continue
        n += p.numel * (args.top_k / args.num_experts if p.expert else 1)
    return 6 * n + attention_flops_per_token(args, seq_len)


def moe_ffn_width(args) -> int:
    """Hidden width a token's feed-forward activations have: top_k routed copies plus the shared
    experts (applied to every block, dense ones included: an upper bound for those)."""
    return args.top_k * args.moe_inter_dim + args.n_shared_experts * args.moe_inter_dim


def moe_routing(args) -> ExpertRouting:
    """``ModelSpec.expert_routing`` of the MoE family."""
    return ExpertRouting(args.num_experts, args.top_k,
                         frozenset(i for i in range(args.n_layers) if args.is_moe_layer(i)))
