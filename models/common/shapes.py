"""The LLaMA family as the layout planner sees it (torch-free): parameters, FLOPs, activation width.

Placements follow models/common/parallelize.py (Megatron-LM TP, arXiv 1909.08053: wq/wk/wv/w1/w3
column-parallel = ``Shard(0)`` of the [out, in] weight, wo/w2 row-parallel = ``Shard(1)``; the
vocab-parallel embedding and the output head ``Shard(0)``; norms replicated). The helpers here are
shared by the families built on this block (models/common/moe_shapes.py).
"""

from __future__ import annotations

from typing import Callable

from models.common.planning import ParamSpec

__all__ = ["transformer_param_shapes", "dense_feed_forward", "llama_param_shapes", "training_flops_per_token",
           "llama_flops_per_token", "llama_ffn_width"]


def dense_feed_forward(args, layer: int, prefix: str) -> list[ParamSpec]:
    """The SwiGLU feed-forward of block ``layer`` ([hidden, dim] w1/w3, [dim, hidden] w2)."""
    hidden, dim = args.ffn_hidden_dim, args.dim
    return [ParamSpec(prefix + "feed_forward.w1.weight", (hidden, dim), layer, tp_dim=0),
            ParamSpec(prefix + "feed_forward.w2.weight", (dim, hidden), layer, tp_dim=1),
            ParamSpec(prefix + "feed_forward.w3.weight", (hidden, dim), layer, tp_dim=0)]


def transformer_param_shapes(args, feed_forward: Callable[[object, int, str], list[ParamSpec]]) -> list[ParamSpec]:
    """Every parameter of a LLaMA-style decoder in module order, each block's feed-forward from
    ``feed_forward(args, layer, "layers.N.")``. Shapes: [out_features, in_features] for linear
    weights (nn.Linear), [vocab, dim] for the embedding and the output head (absent when tied), and
    with ``qk_norm`` the QK-norm weights [head_dim] after each block's wo."""
    dim, head_dim = args.dim, args.head_dim
    params = [ParamSpec("tok_embeddings.weight", (args.vocab_size, dim), None, tp_dim=0)]
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        params += [
            ParamSpec(p + "attention.wq.weight", (args.n_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wk.weight", (args.kv_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wv.weight", (args.kv_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wo.weight", (dim, args.n_heads * head_dim), layer, tp_dim=1),
        ]
        if getattr(args, "qk_norm", False):  # [head_dim] RMSNorm weights, replicated on tp (Qwen3)
            params += [ParamSpec(p + "attention.q_norm.weight", (head_dim,), layer, norm=True),
                       ParamSpec(p + "attention.k_norm.weight", (head_dim,), layer, norm=True)]
        params += feed_forward(args, layer, p)
        params += [ParamSpec(p + "attention_norm.weight", (dim,), layer, norm=True),
                   ParamSpec(p + "ffn_norm.weight", (dim,), layer, norm=True)]
    params.append(ParamSpec("norm.weight", (dim,), None, norm=True))
    if not args.tie_embeddings:
        params.append(ParamSpec("output.weight", (args.vocab_size, dim), None, tp_dim=0))
    return params


def llama_param_shapes(args) -> list[ParamSpec]:
    """``ModelSpec.param_shapes`` of the LLaMA family (``LlamaModelArgs``)."""
    return transformer_param_shapes(args, dense_feed_forward)


def training_flops_per_token(params: list[ParamSpec], seq_len: int, *, blocks: int, heads: int, qk_head_dim: int,
                             v_head_dim: int, tie_embeddings: bool, expert_share: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per token of a decoder, the one formula every family uses:
    6·N + 6·blocks·heads·(qk_head_dim + v_head_dim)·seq_len (PaLM, Chowdhery et al. 2022, App. B).

    6 = 2 (multiply-add) × 3 (forward, and backward for inputs and weights) per weight. N counts
    ``params`` without the embedding (a lookup) unless it is tied to the output head, and a routed
    expert's tensors (``ParamSpec.expert``) at ``expert_share`` (top_k / num_experts: a token runs
    through top_k of them). The second term is the QKᵀ (width qk_head_dim) and PV (width v_head_dim)
    matmuls of ``blocks`` attention layers, without the causal-mask saving, as TorchTitan counts them.

    Raises:
        ValueError: ``seq_len`` not positive.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive (tokens per sequence)")
    n = 0.0
    for p in params:
        if p.name.startswith("tok_embeddings") and not tie_embeddings:
            continue
        n += p.numel * (expert_share if p.expert else 1)
    return 6 * n + 6 * blocks * heads * (qk_head_dim + v_head_dim) * seq_len


def llama_flops_per_token(args, seq_len: int) -> float:
    """``ModelSpec.flops_per_token`` of a dense decoder (:func:`training_flops_per_token`)."""
    return training_flops_per_token(llama_param_shapes(args), seq_len, blocks=args.n_layers, heads=args.n_heads,
                                    qk_head_dim=args.head_dim, v_head_dim=args.head_dim,
                                    tie_embeddings=args.tie_embeddings)


def llama_ffn_width(args) -> int:
    """SwiGLU hidden width each token's activations have in a block (the planner's ``f``)."""
    return args.ffn_hidden_dim
