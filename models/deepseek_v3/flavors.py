"""Named DeepSeek-V3 sizes (``model.flavor`` with ``model.name = "deepseek_v3"``).

Parameter counts are those of transformers' ``DeepseekV3ForCausalLM`` built from the same config
(no multi-token-prediction module), pinned by tests/unit/test_deepseek_v3.py::test_flavor_parameter_counts.
"""

from __future__ import annotations

import dataclasses

from models.deepseek_v3.args import DeepseekV3ModelArgs

__all__ = ["deepseek_v3_flavors"]

_DEBUG = dict(vocab_size=4096, max_seq_len=2048, norm_eps=1e-6, rope_theta=10000.0)

deepseek_v3_flavors: dict[str, DeepseekV3ModelArgs] = {
    # Every MLA and routing feature at CPU size: query latent, 4 heads of q/k width 16 + 8 and value
    # width 12 (v differs from q/k), top-2 of 8 experts in 4 groups of which a token may use 2, one
    # shared expert, the first layer dense, YaRN (factor 4 over 512 positions) with mscale.
    "debugmodel": DeepseekV3ModelArgs(
        dim=64, n_layers=3, n_heads=4, ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=8, top_k=2, moe_inter_dim=32,
        n_shared_experts=1, n_dense_layers=1, n_group=4, topk_group=2, route_scale=2.5,
        load_balance_coeff=1e-3, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=512,
        **_DEBUG),
    # Moonlight-16B-A3B's config (moonshotai/Moonlight-16B-A3B, model_type deepseek_v3): full-rank
    # queries, 64 experts top-6 with 2 shared, the first layer dense, no group limit.
    "16B": DeepseekV3ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_size=11264, q_lora_rank=0,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=64, top_k=6,
        moe_inter_dim=1408, n_shared_experts=2, n_dense_layers=1, n_group=1, topk_group=1,
        route_scale=2.446, rope_theta=50000.0, max_seq_len=8192, norm_eps=1e-5, load_balance_coeff=1e-3),
    # DeepSeek-V3 / V3.1 / R1 (deepseek-ai/DeepSeek-V3's config.json), main model without the MTP
    # module: YaRN factor 40 over 4096 positions to 163840.
    "671B": DeepseekV3ModelArgs(
        max_seq_len=163840, rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_seq_len=4096,
        load_balance_coeff=1e-3),
}
# The debug model with a full-rank query and no YaRN.
deepseek_v3_flavors["debugmodel_noqlora"] = dataclasses.replace(
    deepseek_v3_flavors["debugmodel"], q_lora_rank=0, rope_scaling="none")
# The debug model with two multi-token-prediction depths (the second chains on the first's state).
deepseek_v3_flavors["debugmodel_mtp"] = dataclasses.replace(
    deepseek_v3_flavors["debugmodel"], num_nextn_predict_layers=2)
