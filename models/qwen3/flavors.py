"""Named Qwen3 and Qwen3-MoE sizes (``model.flavor`` with ``model.name = "qwen3"`` / ``"qwen3_moe"``).

The published sizes copy the ``config.json`` of the Qwen/Qwen3-* releases on the Hugging Face Hub
(all: vocabulary 151936, head_dim 128, RoPE theta 1e6, RMSNorm eps 1e-6, 40960 positions). Their
parameter counts equal transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` of the same config
(tests/unit/test_qwen3.py::test_flavor_parameter_counts_equal_transformers). Tying: the published 0.6B,
1.7B and 4B tie their embeddings; as for every model, a run ties them when ``model.tie_embeddings =
true`` (the flavor's value is what a Hugging Face import records and what the counts assume).

The debug flavors take the bundled tokenizer's 4096 tokens and keep what makes Qwen3 differ from
LLaMA: a head width that is not dim / n_heads, QK-norm, theta 1e6; the MoE ones route like Qwen3-MoE
(softmax top-k renormalized, no shared experts, every layer MoE).
"""

from __future__ import annotations

import dataclasses

from models.qwen3.args import Qwen3ModelArgs, Qwen3MoEModelArgs

__all__ = ["qwen3_flavors", "qwen3_moe_flavors"]

_DEBUG = dict(vocab_size=4096, max_seq_len=2048)

qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # 8 heads of 64 on a width of 256 (dim / n_heads = 32): 7,999,488 parameters untied.
    "debugmodel": Qwen3ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_size=64,
                                 ffn_hidden_size=768, **_DEBUG),
    # The test suite's: a quarter of the width, 8 heads of 16 on 64 (dim / n_heads = 8), 8 and 4
    # heads split over every tp degree up to 4. 893,952 parameters untied.
    "debugmodel_tiny": Qwen3ModelArgs(dim=64, n_layers=6, n_heads=8, n_kv_heads=4, head_size=16,
                                      ffn_hidden_size=192, **_DEBUG),
    # Total parameters (tied where published): 596,049,920 / 1,720,574,976 / 4,022,468,096 /
    # 8,190,735,360 / 14,768,307,200 / 32,762,123,264.
    "0.6B": Qwen3ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_size=3072,
                           tie_embeddings=True),
    "1.7B": Qwen3ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_size=6144,
                           tie_embeddings=True),
    "4B": Qwen3ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_size=9728,
                         tie_embeddings=True),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_size=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_size=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_size=25600),
}

qwen3_moe_flavors: dict[str, Qwen3MoEModelArgs] = {
    # Top-4 of 16 experts of width 128, 8 heads of 64 on 256: 9,980,672 total / 5,262,080 active.
    "debugmodel": Qwen3MoEModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_size=64,
                                    ffn_hidden_size=768, num_experts=16, top_k=4, moe_inter_dim=128, **_DEBUG),
    # 30,532,122,624 total / 3,353,032,704 active.
    "30B-A3B": Qwen3MoEModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_size=6144,
                                 num_experts=128, top_k=8, moe_inter_dim=768),
    # 235,093,634,560 total / 22,190,763,520 active.
    "235B-A22B": Qwen3MoEModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_size=12288,
                                   num_experts=128, top_k=8, moe_inter_dim=1536),
}
# The test suite's: debugmodel at a quarter of the width (8 heads of 16 on 64, experts of width 32):
# 1,020,608 total / 725,696 active.
qwen3_moe_flavors["debugmodel_tiny"] = dataclasses.replace(
    qwen3_moe_flavors["debugmodel"], dim=64, head_size=16, ffn_hidden_size=192, moe_inter_dim=32)
