"""Hyper-parameters of the DeepSeek-V3 family (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
arXiv 2412.19437) and their parameter / FLOP accounting; torch-free.

DeepSeek-V3 is the MoE model (``MoEModelArgs``: sigmoid routing, shared experts, the first layers
dense, the auxiliary-loss-free bias and the sequence-wise balance loss) with two changes:

- multi-head latent attention (MLA, DeepSeek-V2, arXiv 2405.04434 §2.1): queries through an
  optional low-rank bottleneck (``q_lora_rank``), keys and values from one joint latent of width
  ``kv_lora_rank`` (RMSNorm'd), each head's query/key split into a non-rotated part
  (``qk_nope_head_dim``) and a RoPE part (``qk_rope_head_dim``, one rotated key shared by all
  heads), values of their own width ``v_head_dim``;
- group-limited routing: the experts form ``n_group`` groups, a token may only pick experts of its
  ``topk_group`` best groups (group score: sum of its 2 best biased scores).

RoPE scaling "yarn" (Peng et al. 2023, "YaRN", arXiv 2309.00071) is the published checkpoints'
long-context extension; see models/deepseek_v3/yarn.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from models.common.moe_args import MoEModelArgs

__all__ = ["DeepseekV3ModelArgs", "yarn_mscale"]


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term 0.1 · mscale · ln(factor) + 1 (1 for factor <= 1); arXiv
    2309.00071 eq. 22 with DeepSeek's ``mscale`` multiplier (DeepSeek-V2's reference code)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class DeepseekV3ModelArgs(MoEModelArgs):
    """``MoEModelArgs`` plus MLA, group-limited routing and YaRN (defaults: DeepSeek-V3's shape).

    Attributes (in addition to ``MoEModelArgs``; ``n_kv_heads``, ``head_size``, ``qk_norm`` unused):
        q_lora_rank: width of the query latent (wq_a [q_lora_rank, dim], RMSNorm, wq_b); 0 = one
            full-rank wq [n_heads · qk_head_dim, dim] (the 16B-class models).
        kv_lora_rank: width of the joint key-value latent (wkv_a's first kv_lora_rank channels).
        qk_nope_head_dim, qk_rope_head_dim: non-rotated and rotated channels of one query/key head.
        v_head_dim: channels of one value head.
        n_group, topk_group: routing groups and how many of them a token may use (1, 1 = no limit).
        rope_scaling: "none" or "yarn"; with "yarn": rope_scaling_factor (s), rope_original_max_seq_len,
            rope_yarn_beta_fast / _beta_slow (rotation bounds α, β of arXiv 2309.00071 §3.2),
            rope_yarn_mscale / _mscale_all_dim (DeepSeek's temperature multipliers: the cos/sin
            tables are scaled by mscale(s, mscale) / mscale(s, mscale_all_dim) and the softmax
            scale by mscale(s, mscale_all_dim)², as transformers' DeepseekV3).
        num_nextn_predict_layers: multi-token-prediction depths D (models/deepseek_v3/mtp.py); 0 = none.
    """

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    ffn_hidden_size: int | None = 18432
    num_experts: int = 256
    top_k: int = 8
    moe_inter_dim: int = 2048
    n_shared_experts: int = 1
    n_dense_layers: int = 3
    score_func: str = "sigmoid"
    route_scale: float = 2.5
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 1.0
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        """Channels of one query/key head: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The query/key head width (what SDPA's default scale 1/sqrt(head_dim) is taken over)."""
        return self.qk_head_dim

    @property
    def n_routed_blocks(self) -> int:
        """MoE blocks of the main model and of the multi-token-prediction depths (depth k's block has
        layer_id n_layers + k - 1, models/deepseek_v3/mtp.py)."""
        return self.n_moe_layers + sum(self.is_moe_layer(self.n_layers + k)
                                       for k in range(self.num_nextn_predict_layers))

    @property
    def yarn_enabled(self) -> bool:
        return self.rope_scaling == "yarn"

    @property
    def rope_attention_factor(self) -> float:
        """Factor on the cos/sin tables (1 without YaRN)."""
        if not self.yarn_enabled:
            return 1.0
        s, m, m_all = self.rope_scaling_factor, self.rope_yarn_mscale, self.rope_yarn_mscale_all_dim
        if m and m_all:
            return yarn_mscale(s, m) / yarn_mscale(s, m_all)
        return yarn_mscale(s, 1.0)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times mscale(s, mscale_all_dim)² with YaRN (DeepSeek-V2 §2.1 / YaRN)."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn_enabled and self.rope_yarn_mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling_factor, self.rope_yarn_mscale_all_dim) ** 2
        return scale

    def validate(self) -> None:
        """Check the MoE settings (RoPE scaling aside), then MLA, routing groups and YaRN.

        Raises:
            ValueError: naming the field, its value and what it must satisfy.
        """
        MoEModelArgs.validate(dataclasses.replace(self, rope_scaling="none", head_size=self.qk_head_dim))
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DeepseekV3ModelArgs.{name}={value!r} must be a positive integer")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ValueError(f"DeepseekV3ModelArgs.q_lora_rank={self.q_lora_rank!r} must be an integer >= 0 "
                             "(0 = a full-rank query projection)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV3ModelArgs.qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates "
                             "channel pairs")
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError(f"DeepseekV3ModelArgs.n_kv_heads={self.n_kv_heads}: MLA has one key/value per head; "
                             "leave n_kv_heads unset")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"DeepseekV3ModelArgs n_group={self.n_group}, topk_group={self.topk_group}: n_group "
                             f"must divide num_experts={self.num_experts} and 1 <= topk_group <= n_group")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"DeepseekV3ModelArgs n_group={self.n_group}: a group's score sums its 2 best experts; "
                             "each group needs >= 2 experts")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"DeepseekV3ModelArgs.top_k={self.top_k} exceeds the experts of topk_group="
                             f"{self.topk_group} groups; raise topk_group")
        if self.rope_scaling not in ("none", "yarn"):
            raise ValueError(f"DeepseekV3ModelArgs.rope_scaling={self.rope_scaling!r}: choose \"none\" or \"yarn\"")
        if self.yarn_enabled and not (self.rope_scaling_factor > 0 and self.rope_original_max_seq_len > 0
                                      and self.rope_yarn_beta_fast > self.rope_yarn_beta_slow > 0):
            raise ValueError("DeepseekV3ModelArgs yarn RoPE needs factor > 0, original_max_seq_len > 0 and "
                             f"beta_fast > beta_slow > 0; got factor={self.rope_scaling_factor}, original_max_seq_len="
                             f"{self.rope_original_max_seq_len}, beta_fast={self.rope_yarn_beta_fast}, "
                             f"beta_slow={self.rope_yarn_beta_slow}")
        n = self.num_nextn_predict_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"DeepseekV3ModelArgs.num_nextn_predict_layers={n!r} must be an integer >= 0 "
                             "(multi-token-prediction depths; 0 = none)")
