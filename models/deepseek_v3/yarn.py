"""RoPE tables of the DeepSeek-V3 family: plain RoPE (Su et al. 2021, arXiv 2104.09864) or YaRN
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
arXiv 2309.00071), the scaling of the published DeepSeek-V3 checkpoints.

YaRN's frequencies are models/common/rope.py ``yarn_frequencies`` (shared with Qwen3). The
temperature ("attention factor", eq. 22) is applied to the cos/sin tables, and DeepSeek's
``mscale_all_dim`` to the softmax scale (models/deepseek_v3/args.py).
"""

from __future__ import annotations

import torch  # noqa: F401  (annotations)

from models.common.rope import precompute_rope, yarn_frequencies  # (yarn_frequencies re-exported)

__all__ = ["yarn_frequencies", "deepseek_rope_tables"]


def deepseek_rope_tables(args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, qk_rope_head_dim // 2] of a ``DeepseekV3ModelArgs``, float32 (float64
    when that is torch's default dtype), times YaRN's attention factor when ``rope_scaling = "yarn"``
    (models/common/rope.py ``precompute_rope`` with DeepSeek's attention factor)."""
    return precompute_rope(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, device,
                           yarn=args.rope_yarn_params, attention_factor=args.rope_attention_factor)
