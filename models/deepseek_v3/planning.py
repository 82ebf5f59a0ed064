"""The DeepSeek-V3 family as the layout planner sees it (torch-free): parameters, FLOPs, width, routing.

Placements follow models/deepseek_v3/parallelize.py: MLA's per-head projections wq / wq_b and wkv_b
column-parallel (``tp_dim`` 0), wo row-parallel (1); the latents wq_a, wkv_a replicated on tp and
their RMSNorms (``norm``) too; the feed-forwards as the MoE family's (models/common/moe_shapes.py): routed
experts over ep, the router replicated, shared experts and dense layers column/row-parallel.
"""

from __future__ import annotations

import dataclasses

from models.common.moe_shapes import moe_feed_forward, moe_ffn_width
from models.common.shapes import training_flops_per_token
from models.common.planning import AttentionActivations, FeedForwardActivations, ParamSpec

__all__ = ["deepseek_v3_param_shapes", "deepseek_v3_flops_per_token", "deepseek_v3_attention_activations",
           "deepseek_v3_ffn_activations", "deepseek_v3_prediction_blocks"]


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
    # Multi-token prediction embeds tokens beside the head: a pipeline's last stage holds a copy.
    params = [ParamSpec("tok_embeddings.weight", (args.vocab_size, dim), None, tp_dim=0,
                        on_last_stage=args.num_nextn_predict_layers > 0)]
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        params += _mla(args, layer, p) + moe_feed_forward(args, layer, p)
        params += [ParamSpec(p + "attention_norm.weight", (dim,), layer, norm=True),
                   ParamSpec(p + "ffn_norm.weight", (dim,), layer, norm=True)]
    params.append(ParamSpec("norm.weight", (dim,), None, norm=True))
    if not args.tie_embeddings:
        params.append(ParamSpec("output.weight", (args.vocab_size, dim), None, tp_dim=0))
    return params + _mtp(args)


def _mtp(args) -> list[ParamSpec]:
    """The multi-token-prediction modules' parameters (models/deepseek_v3/mtp.py ``MTPModule``, module
    order), ``layer`` None: they sit beside the output head (last stage, FSDP's root unit)."""
    dim, params = args.dim, []
    for k in range(args.num_nextn_predict_layers):
        layer, p = args.n_layers + k, f"mtp.{k}."
        block = _mla(args, layer, p + "block.") + moe_feed_forward(args, layer, p + "block.") + [
            ParamSpec(p + "block.attention_norm.weight", (dim,), layer, norm=True),
            ParamSpec(p + "block.ffn_norm.weight", (dim,), layer, norm=True)]
        params += [ParamSpec(p + "enorm.weight", (dim,), None, norm=True),
                   ParamSpec(p + "hnorm.weight", (dim,), None, norm=True),
                   ParamSpec(p + "eh_proj.weight", (dim, 2 * dim), None)]
        params += [dataclasses.replace(spec, layer=None) for spec in block]
        params.append(ParamSpec(p + "norm.weight", (dim,), None, norm=True))
    return params


def deepseek_v3_flops_per_token(args, seq_len: int) -> float:
    """``ModelSpec.flops_per_token``: :func:`models.common.shapes.training_flops_per_token` with MLA's
    own query/key and value widths, active experts only, the MTP depths' blocks counted as blocks,
    plus the shared output head run once more by each MTP depth (6 · vocab · dim per depth: the
    parameter is counted once in N, its matmul D + 1 times; arXiv 2412.19437 §2.2 shares the head)."""
    heads_again = 6 * args.num_nextn_predict_layers * args.vocab_size * args.dim
    return heads_again + training_flops_per_token(
        deepseek_v3_param_shapes(args), seq_len, blocks=args.n_layers + args.num_nextn_predict_layers,
        heads=args.n_heads, qk_head_dim=args.qk_head_dim, v_head_dim=args.v_head_dim,
        tie_embeddings=args.tie_embeddings, expert_share=args.top_k / args.num_experts)


def deepseek_v3_attention_activations(args) -> AttentionActivations:
    """``ModelSpec.attention_activations`` of MLA (models/deepseek_v3/model.py ``MLAttention``), per
    token, H heads, r_q = q_lora_rank, r_kv = kv_lora_rank:

    - split with the heads: q and k at the kernel (H·qk_head_dim each), v and the output's copy for
      wo (H·v_head_dim each); without YaRN's q scale q is wq's / wq_b's output itself;
    - replicated on tp: wkv_a's output (r_kv + qk_rope_head_dim, whose latent kv_norm keeps), the
      norm's normalized tensor and output (r_kv each) and rstd (1); with a query latent the same
      for wq_a / q_norm (3·r_q + 1);
    - matmuls wq_a (r_q), wq_b (H·qk_head_dim) or wq, wkv_a (r_kv + rope), wkv_b (H·(nope + v)), wo (dim);
    - in backward the gradients of q, k (H·qk_head_dim each) and v, the output, its copy (H·v_head_dim).
    DeepSeek-V2 arXiv 2405.04434 §2.1 for the data flow; the tensors are those torch's autograd
    saves (``torch.autograd.graph.saved_tensors_hooks``) in one MLA forward on the CPU.
    """
    h, qk, v, rope = args.n_heads, args.qk_head_dim, args.v_head_dim, args.qk_rope_head_dim
    r_q, r_kv = args.q_lora_rank, args.kv_lora_rank
    replicated = r_kv + rope + 2 * r_kv + 1 + (3 * r_q + 1 if r_q else 0)
    dim = args.dim
    q_matmuls = ((r_q, dim, False), (h * qk, r_q, True)) if r_q else ((h * qk, dim, True),)
    matmuls = q_matmuls + ((r_kv + rope, dim, False), (h * (args.qk_nope_head_dim + v), r_kv, True),
                           (dim, h * v, False))
    return AttentionActivations(heads=h, qk_head_dim=qk, v_head_dim=v, split=2 * h * qk + 2 * h * v,
                                replicated=replicated, matmuls=matmuls, backward=2 * h * qk + 3 * h * v)


def deepseek_v3_prediction_blocks(args) -> tuple[int, ...]:
    """``ModelSpec.prediction_blocks``: the MTP depths' blocks, numbered n_layers + k as in
    models/deepseek_v3/mtp.py (each also has its input projection and its own loss)."""
    return tuple(range(args.n_layers, args.n_layers + args.num_nextn_predict_layers))


def deepseek_v3_ffn_activations(args, layer: int) -> FeedForwardActivations:
    """``ModelSpec.ffn_activations`` of block ``layer``: a dense block's SwiGLU (``ffn_hidden_size``);
    an MoE block's top_k routed and shared experts' SwiGLU (models/common/moe_shapes.py
    ``moe_ffn_width``) and, kept on every rank, the routed copies of the token at the experts'
    input and output and in the weighted sum (3·top_k·dim), the token's input kept for the
    combine (dim), the sigmoid scores (E) and the top-k weights and int64 indices (about 4·top_k
    + 4 elements); the tensors torch's autograd saves in one CPU forward of models/common/moe.py."""
    if not args.is_moe_layer(layer):
        return FeedForwardActivations(args.ffn_hidden_dim)
    k = args.top_k
    return FeedForwardActivations(moe_ffn_width(args), 3 * k * args.dim + args.dim + args.num_experts + 4 * k + 4)
