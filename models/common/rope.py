"""Rotary position embedding (RoPE; Su et al. 2021, arXiv 2104.09864) with Llama 3.1's frequency
scaling or YaRN's: the frequencies, the cos/sin tables and the rotation of queries and keys, as real tensors
(no complex dtype: friendlier to DTensor and torch.compile). models/common/decoder.py re-exports them.
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(
    head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """RoPE inverse frequencies theta^(-2i / head_dim) for the head_dim/2 channel pairs (Su et al. 2021).

    With ``scaling = (factor, low_freq_factor, high_freq_factor, original_max_seq_len)`` they are
    scaled as in Llama 3.1 (Grattafiori et al. 2024; Meta's reference ``apply_scaling``): with
    wavelength 2*pi/f, frequencies whose wavelength exceeds original_max_seq_len / low_freq_factor
    are divided by ``factor``, those below original_max_seq_len / high_freq_factor are kept, and in
    between s = (original_max_seq_len / wavelength - low) / (high - low) blends them:
    f' = (1 - s) * f / factor + s * f.

    Returns:
        float64 [head_dim // 2] (radians per token) on ``device``.
    """
    pair = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
    inv_freq = 1.0 / (theta ** (pair / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    # Equivalent with >= / <= (mutation testing): on a band's edge the blend already equals that band's value
    # (s = 0 gives f / factor, s = 1 gives f), and 2*pi / f never lands on an edge but for contrived floats.
    scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def _correction_dim(rotations: float, dim: int, base: float, original: int) -> float:
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(dim: int, base: float, factor: float, original: int, beta_fast: float,
                     beta_slow: float, device=None) -> torch.Tensor:
    """YaRN's inverse frequencies (Peng et al. 2023, "YaRN", arXiv 2309.00071, §3.2 "NTK-by-parts"),
    float64 [dim // 2] (radians per token).

    For each frequency the number of rotations it makes over the original context L decides how it
    is scaled: fewer than β rotations are interpolated (divided by the factor s), more than α kept,
    in between blended by a linear ramp over the channel index; with d the rotated width and b the
    base, the ramp runs between the channels d·ln(L / (2π·r)) / (2·ln b) for r = α (beta_fast) and
    r = β (beta_slow), floored / ceiled (transformers' ``_compute_yarn_parameters``, DeepSeek's
    reference ``precompute_freqs_cis``).

    Args:
        dim: rotated channels; base: RoPE theta; factor: s; original: the pre-training context L
            (tokens); beta_fast, beta_slow: α, β (rotations).
    """
    inv_freq = rope_frequencies(dim, base, device=device)
    low = max(math.floor(_correction_dim(beta_fast, dim, base, original)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, original)), dim - 1)
    if low == high:
        high += 0.001  # one-channel ramp (as the references)
    # (dim / 2 for dim // 2 is equivalent for the even widths RoPE takes: arange(8.0) == arange(8))
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (frequency / s)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(factor: float) -> float:
    """YaRN's temperature on the cos/sin tables, sqrt(1/t) = 0.1·ln(s) + 1 (arXiv 2309.00071, eq. 22;
    1 for s <= 1), as transformers applies it when a config sets no ``attention_factor``."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0  # (>= 1 alike: ln 1 = 0 gives 1.0 exactly)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None,
    scaling: tuple[float, float, float, int] | None = None,
    yarn: tuple[float, int, float, float] | None = None, attention_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables as real cos/sin (no complex dtype: friendlier to DTensor and torch.compile).

    angle[p, i] = p * f_i for position p < max_seq_len and pair i < head_dim/2, with the
    frequencies f of :func:`rope_frequencies` (``scaling``: Llama 3.1's, or None), or with
    ``yarn = (factor, original_max_seq_len, beta_fast, beta_slow)`` those of
    :func:`yarn_frequencies` and both tables times YaRN's attention factor: ``attention_factor``, or
    by default :func:`yarn_attention_factor` (Qwen3's long context; DeepSeek-V3 derives its own from
    mscale, models/deepseek_v3/args.py).
    Computed in float64 (positions up to 131072 lose ~1e-2 rad in float32), returned as float32
    (float64 when that is torch's default dtype: the float64 reference mode).

    Returns:
        (cos, sin), each float32 [max_seq_len, head_dim // 2] on `device` (default device if None).
    """
    if yarn is not None:
        factor, original, beta_fast, beta_slow = yarn
        inv_freq = yarn_frequencies(head_dim, theta, factor, original, beta_fast, beta_slow, device=device)
    else:
        inv_freq = rope_frequencies(head_dim, theta, scaling, device=device)
    # (an int64 arange would be equivalent: torch.outer promotes the exact integers to float64)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
    if attention_factor is None:
        attention_factor = yarn_attention_factor(yarn[0]) if yarn is not None else 1.0
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of `x` by the angles in cos/sin (Meta's interleaved layout).

    Args:
        x: [B, S, H, head_dim] queries or keys.
        cos, sin: [S, head_dim // 2] float32 tables for the S positions of `x`, or [B, S, head_dim // 2]
            when each sequence has its own positions (RoPE restarting at each packed document).
    Returns:
        [B, S, H, head_dim] in the dtype of `x` (the rotation itself runs in float32).
    """
    # The cast is equivalent to none while the tables are float32 or wider (the products promote to them): it
    # keeps the rotation in float32 should a caller pass bf16 tables.
    pairs = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # [B, S, H, head_dim/2, 2]
    x0, x1 = pairs.unbind(-1)
    # Equivalent variants (mutation testing): unsqueeze(2) is unsqueeze(-2) on a 3-D table, and a 2-D table
    # [S, D/2] unsqueezed at -2 broadcasts as [1, S, 1, D/2], i.e. as the indexing below.
    cos = cos.unsqueeze(-2) if cos.dim() == 3 else cos[None, :, None, :]
    sin = sin.unsqueeze(-2) if sin.dim() == 3 else sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
