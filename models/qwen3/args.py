"""Hyper-parameters of the Qwen3 family: LLaMA's and the MoE model's with Qwen3's defaults.

Qwen3 (Qwen Team 2025, "Qwen3 Technical Report", arXiv 2505.09388) is LLaMA-3's architecture
(pre-norm RMSNorm blocks, RoPE, grouped-query attention, SwiGLU) with two changes, both options of
``LlamaModelArgs``: an RMSNorm on each head's queries and keys before RoPE (``qk_norm``), and a head
width set on its own (``head_size``, Hugging Face's ``head_dim``: 128 in every published size, so
n_heads * head_dim need not equal dim). Qwen3-MoE replaces every feed-forward by 128 routed SwiGLU
experts, top-8 of a softmax over all experts renormalized over the chosen 8, no shared experts
(``MoEModelArgs`` with score_func "softmax", route_norm, n_shared_experts 0, n_dense_layers 0).

No new fields: the classes exist so that a Qwen3 checkpoint's record (models/registry.py) names its
family, and so that Qwen3's defaults (theta 1e6, eps 1e-6, QK-norm, head 128) are in one place.
FLOPs per token are the common decoders' (models/common/shapes.py ``training_flops_per_token``),
whose attention term uses ``head_dim`` (= ``head_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import LlamaModelArgs
from models.common.moe_args import MoEModelArgs

__all__ = ["Qwen3ModelArgs", "Qwen3MoEModelArgs"]


@dataclass
class Qwen3ModelArgs(LlamaModelArgs):
    """Dense Qwen3: ``LlamaModelArgs`` with Qwen3's defaults (Qwen3-8B's shape).

    ``ffn_hidden_size`` is Hugging Face's ``intermediate_size``, always given explicitly (Qwen3's
    widths follow no multiple_of rule); ``tie_embeddings`` as published (0.6B, 1.7B, 4B tie).
    """

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    ffn_hidden_size: int | None = 12288
    head_size: int | None = 128
    qk_norm: bool = True


@dataclass
class Qwen3MoEModelArgs(Qwen3ModelArgs, MoEModelArgs):
    """Qwen3-MoE: Qwen3's attention defaults (``Qwen3ModelArgs``) with the MoE decoder's fields
    (``MoEModelArgs``: softmax routing renormalized over the chosen experts, no shared experts, every
    layer MoE, no routing bias, all its defaults), at Qwen3-30B-A3B's shape.

    Routing as Hugging Face's ``norm_topk_prob`` (decoder_sparse_step 1, no ``mlp_only_layers``).
    ``aux_loss_coeff`` is Hugging Face's ``router_aux_loss_coef`` (0.001), applied to Quadra's
    sequence-wise balance loss (models/common/moe.py) rather than transformers' loss over the whole
    batch. ``ffn_hidden_size`` keeps the published ``intermediate_size``, which no layer uses.
    """

    dim: int = 2048
    n_layers: int = 48
    n_kv_heads: int | None = 4
    ffn_hidden_size: int | None = 6144
    num_experts: int = 128
    top_k: int = 8
    moe_inter_dim: int = 768
    aux_loss_coeff: float = 0.001
