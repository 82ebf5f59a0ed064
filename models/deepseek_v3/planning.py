"""The DeepSeek-V3 family as the layout planner sees it (torch-free): parameters, FLOPs, width, routing.

Placements follow models/deepseek_v3/parallelize.py: MLA's per-head projections wq / wq_b and wkv_b
column-parallel (``tp_dim`` 0), wo row-parallel (1); the latents wq_a, wkv_a replicated on tp and
their RMSNorms (``norm``) too; the feed-forwards as the MoE family's (models/moe/planning.py): routed
experts over ep, the router replicated, shared experts and dense layers column/row-parallel.
"""

from __future__ import annotations

from models.moe.planning import _moe_feed_forward, moe_ffn_width, moe_routing
from models.planning import ExpertRouting, ParamSpec

__all__ = ["deepseek_v3_param_shapes", "deepseek_v3_flops_per_token", "deepseek_v3_ffn_width",
           "deepseek_v3_routing"]


def _mla(args, layer: int, p: str) -> list[ParamSpec]:
    """MLA's parameters of block ``layer`` in module order (models/deepseek_v3/model.py ``MLAttention``)."""
    a, dim, heads = p + "attention.", args.dim, args.n_heads
    if args.q_lora_rank:
        params = [ParamSpec(a + "wq_a.weight", (args.q_lora_rank, dim), layer),
                  ParamSpec(a + "q_norm.weight", (args.q_lora_rank,), layer, norm=True),
                  ParamSpec(a + "wq_b.weight", (heads * args.qk_head_dim, args.q_lora_rank), layer, tp_dim=0)]
    else:
        params = [ParamSpec(a + "wq.weight", (heads * args.qk_head_dim, dim), layer, tp_dim=0)]
    return params + [
        ParamSpec(a + "wkv_a.weight", (args.kv_lora_rank + args.qk_rope_head_dim, dim), layer),
        ParamSpec(a + "kv_norm.weight", (args.kv_lora_rank,), layer, norm=True),
        ParamSpec(a + "wkv_b.weight", (heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
                  layer, tp_dim=0),
        ParamSpec(a + "wo.weight", (dim, heads * args.v_head_dim), layer, tp_dim=1),
    ]


def deepseek_v3_param_shapes(args) -> list[ParamSpec]:
    """``ModelSpec.param_shapes`` of DeepSeek-V3 (``DeepseekV3ModelArgs``), in module order."""
    dim = args.dim
    params = [ParamSpec("tok_embeddings.weight", (args.vocab_size, dim), None, tp_dim=0)]
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        params += _mla(args, layer, p) + _moe_feed_forward(args, layer, p)
        params += [ParamSpec(p + "attention_norm.weight", (dim,), layer, norm=True),
                   ParamSpec(p + "ffn_norm.weight", (dim,), layer, norm=True)]
    params.append(ParamSpec("norm.weight", (dim,), None, norm=True))
    if not args.tie_embeddings:
        params.append(ParamSpec("output.weight", (args.vocab_size, dim), None, tp_dim=0))
    return params


def deepseek_v3_flops_per_token(args, seq_len: int) -> float:
    """6·N_active + 6·L·n_heads·(qk_head_dim + v_head_dim)·seq_len (PaLM App. B; QKᵀ and PV of
    their own widths), as ``DeepseekV3ModelArgs.get_nparams_and_flops``."""
    n = 0.0
    for p in deepseek_v3_param_shapes(args):
        if p.name.startswith("tok_embeddings") and not args.tie_embeddings:
            continue
        n += p.numel * (args.top_k / args.num_experts if p.expert else 1)
    return 6 * n + 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len


def deepseek_v3_ffn_width(args) -> int:
    """top_k routed copies plus the shared experts' width (models/moe/planning.py ``moe_ffn_width``)."""
    return moe_ffn_width(args)


def deepseek_v3_routing(args) -> ExpertRouting:
    """``ModelSpec.expert_routing``: top_k of num_experts from layer n_dense_layers on."""
    return moe_routing(args)
