"""The Qwen3 families as the layout planner sees them (torch-free): parameters, FLOPs, width, routing.

The modules and plans are LLaMA's and the MoE model's (models/common/parallelize.py,
models/common/moe_parallelize.py), so are their planner views (models/common/shapes.py,
models/common/moe_shapes.py), which list what Qwen3 adds: q/k/v/o widths of ``n_heads * head_dim`` with
head_dim free of dim / n_heads, and the QK-norm weights [head_dim] per block, replicated on every tp
rank with or without sequence parallel (a Replicate DTensor whose gradient is summed over tp), so
``norm`` entries. FLOPs per token: 6·N + 12·L·n_heads·head_dim·seq_len (PaLM App. B), active
experts only for the MoE.
"""

from __future__ import annotations

from models.common.shapes import llama_ffn_width, llama_flops_per_token, llama_param_shapes
from models.common.moe_shapes import moe_ffn_width, moe_flops_per_token, moe_param_shapes, moe_routing
from models.common.planning import ExpertRouting, ParamSpec

__all__ = ["qwen3_param_shapes", "qwen3_flops_per_token", "qwen3_ffn_width", "qwen3_moe_param_shapes",
           "qwen3_moe_flops_per_token", "qwen3_moe_ffn_width", "qwen3_moe_routing"]


def qwen3_param_shapes(args) -> list[ParamSpec]:
    """``ModelSpec.param_shapes`` of Qwen3 (``Qwen3ModelArgs``), in module order."""
    return llama_param_shapes(args)


def qwen3_flops_per_token(args, seq_len: int) -> float:
    """Training FLOPs per token of Qwen3 at ``seq_len`` (``LlamaModelArgs.get_nparams_and_flops``)."""
    return llama_flops_per_token(args, seq_len)


def qwen3_ffn_width(args) -> int:
    """SwiGLU hidden width of a token's activations (``intermediate_size``)."""
    return llama_ffn_width(args)


def qwen3_moe_param_shapes(args) -> list[ParamSpec]:
    """``ModelSpec.param_shapes`` of Qwen3-MoE (``Qwen3MoEModelArgs``), in module order."""
    return moe_param_shapes(args)


def qwen3_moe_flops_per_token(args, seq_len: int) -> float:
    """Training FLOPs per token of Qwen3-MoE, active experts only (``MoEModelArgs.get_nparams_and_flops``)."""
    return moe_flops_per_token(args, seq_len)


def qwen3_moe_ffn_width(args) -> int:
    """top_k · moe_inter_dim: the routed copies of a token's feed-forward activations."""
    return moe_ffn_width(args)


def qwen3_moe_routing(args) -> ExpertRouting:
    """``ModelSpec.expert_routing`` of Qwen3-MoE: every layer routes, top_k of num_experts."""
    return moe_routing(args)
