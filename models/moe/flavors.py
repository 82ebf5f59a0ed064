"""Named MoE sizes (``model.flavor`` with ``model.name = "moe"``).

Parameter counts (total / active per token, untied embeddings, at the flavor's vocab_size) are
pinned by tests/unit/test_moe.py::test_flavor_parameter_counts.
"""

from __future__ import annotations

import dataclasses

from models.common.moe_args import MoEModelArgs

__all__ = ["moe_flavors"]

moe_flavors: dict[str, MoEModelArgs] = {
    # DeepSeek-V3-style routing at CPU size: sigmoid scores, renormalized top-2 of 8, one shared
    # expert, the first layer dense, auxiliary-loss-free balancing. 6,136,064 total / 4,366,592 active.
    "debugmodel": MoEModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_inter_dim=128,
        n_shared_experts=1,
        n_dense_layers=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        load_balance_coeff=1e-3,
        aux_loss_coeff=0.0,
    ),
    # Mixtral-style routing at CPU size: softmax top-2 of 8, no shared or dense layers, the
    # classic balance loss with coefficient 0.01. 6,039,808 total / 3,680,512 active.
    "debugmodel_mixtral": MoEModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_inter_dim=128,
        score_func="softmax",
        route_norm=True,
        aux_loss_coeff=0.01,
    ),
    # DeepSeek-V2-Lite / Moonlight shape with LLaMA attention instead of MLA: 64 routed experts of
    # width 1408, top-6, 2 shared experts, first layer dense (width 11008).
    # 15,788,259,328 total / 2,742,925,312 active.
    "16B": MoEModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=102400,
        multiple_of=256,
        ffn_dim_multiplier=2.0,
        rope_theta=10000.0,
        max_seq_len=4096,
        num_experts=64,
        top_k=6,
        moe_inter_dim=1408,
        n_shared_experts=2,
        n_dense_layers=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        load_balance_coeff=1e-3,
        aux_loss_coeff=0.0,
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 46,702,792,704 total / 12,879,925,248 active.
    "mixtral_8x7b": MoEModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        multiple_of=1024,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_seq_len=32768,
        num_experts=8,
        top_k=2,
        moe_inter_dim=14336,
        score_func="softmax",
        route_norm=True,
        aux_loss_coeff=0.02,
    ),
}

# The test suite's sizes: debugmodel's and debugmodel_mixtral's routing at a quarter of the width (dim
# 64, experts of width 32), so a multi-process step costs a fraction of theirs.
for _name in ("debugmodel", "debugmodel_mixtral"):
    moe_flavors[f"{_name}_tiny"] = dataclasses.replace(moe_flavors[_name], dim=64, multiple_of=64, moe_inter_dim=32)
