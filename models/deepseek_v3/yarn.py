"""RoPE tables of the DeepSeek-V3 family: plain RoPE (Su et al. 2021, arXiv 2104.09864) or YaRN
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
arXiv 2309.00071), the scaling of the published DeepSeek-V3 checkpoints.

YaRN ("NTK-by-parts", §3.2 of the paper): for each frequency the number of rotations it makes over
the original context L decides how it is scaled. Frequencies with fewer than β rotations are
interpolated (divided by the factor s), those with more than α kept, those in between blended by a
linear ramp over the channel index; with d the rotated width and b the base, the ramp runs between
the channels d·ln(L / (2π·r)) / (2·ln b) for r = α (beta_fast) and r = β (beta_slow), floored / ceiled
(transformers' ``_compute_yarn_parameters``, DeepSeek's reference ``precompute_freqs_cis``). The
temperature ("attention factor", eq. 22) is applied to the cos/sin tables, and DeepSeek's
``mscale_all_dim`` to the softmax scale (models/deepseek_v3/args.py).
"""

from __future__ import annotations

import math

import torch

from models.llama.rope import rope_frequencies

__all__ = ["yarn_frequencies", "deepseek_rope_tables"]


def _correction_dim(rotations: float, dim: int, base: float, original: int) -> float:
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(dim: int, base: float, factor: float, original: int, beta_fast: float,
                     beta_slow: float, device=None) -> torch.Tensor:
    """YaRN's inverse frequencies, float64 [dim // 2] (radians per token).

    Args:
        dim: rotated channels (qk_rope_head_dim); base: RoPE theta; factor: s; original: the
            pre-training context L (tokens); beta_fast, beta_slow: α, β (rotations).
    """
    inv_freq = rope_frequencies(dim, base, device=device)
    low = max(math.floor(_correction_dim(beta_fast, dim, base, original)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, original)), dim - 1)
    if low == high:
        high += 0.001  # one-channel ramp (as the references)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (frequency / s)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def deepseek_rope_tables(args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, qk_rope_head_dim // 2] of a ``DeepseekV3ModelArgs``, float32 (float64
    when that is torch's default dtype), times YaRN's attention factor when ``rope_scaling = "yarn"``."""
    dim = args.qk_rope_head_dim
    if args.yarn_enabled:
        inv_freq = yarn_frequencies(dim, args.rope_theta, args.rope_scaling_factor, args.rope_original_max_seq_len,
                                    args.rope_yarn_beta_fast, args.rope_yarn_beta_slow, device=device)
    else:
        inv_freq = rope_frequencies(dim, args.rope_theta, device=device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float64), inv_freq)
    dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
    factor = args.rope_attention_factor
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)
