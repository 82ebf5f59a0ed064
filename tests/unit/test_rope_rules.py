"""RoPE's rules (models/common/rope.py, models/deepseek_v3/yarn.py) against oracles outside Quadra: transformers'
RoPE initialisations (``ROPE_INIT_FUNCTIONS`` "default", "llama3", "yarn"; float32 there), the closed formulas
(theta^(-2i/d); cos/sin of p * f_i times YaRN's attention factor, arXiv 2309.00071 eq. 22) and Meta's reference
rotation (a complex product of each channel pair with e^(i p f), llama/model.py ``apply_rotary_emb``), computed
here in float64. Unit level, a few seconds: the fast selection that scripts/mutation.sh runs for these modules.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.common.rope import apply_rope, precompute_rope, rope_frequencies, yarn_attention_factor, yarn_frequencies

# (head_dim, theta, factor, low_freq_factor, high_freq_factor, original): Llama 3.1 8B's published scaling (all
# three bands: 8 kept, 36 blended... of 64 pairs), Llama 3.2's factor 32, and a short original context.
LLAMA3 = [(128, 500000.0, 8.0, 1.0, 4.0, 8192), (128, 500000.0, 32.0, 1.0, 4.0, 8192), (64, 10000.0, 4.0, 2.0, 8.0, 64)]
# (head_dim, theta, factor, original, beta_fast, beta_slow): DeepSeek-V3's published YaRN (ramp over pairs 10..23
# of 32), Qwen3's (factor 4 from 32768 at theta 1e6), a ramp clamped at both ends, one whose upper bound clamps to
# dim - 1 = 15 (ceil gives 16) while its ramp starts at pair 5 < dim / 2, a one-channel ramp at channel 0 (both
# bounds clamp to 0) and one at the last channel (both bounds at dim - 1: the "+ 0.001" of the references).
YARN = [(64, 10000.0, 40.0, 4096, 32.0, 1.0), (128, 1000000.0, 4.0, 32768, 32.0, 1.0),
        (16, 10000.0, 8.0, 4096, 2.0, 0.01),
        (16, 10000.0, 8.0, 200000, 32.0, 0.001), (16, 10000.0, 4.0, 6, 32.0, 1.0),
        (16, 10000.0, 4.0, 6_400_000_000, 32.0, 1.0)]
YARN_IDS = ["deepseek_v3", "qwen3", "clamped", "clamped_high", "one_channel_0", "one_channel_last"]


def _hf_llama_config(head_dim: int, theta: float, rope_scaling: dict | None) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    rope_theta=theta, rope_scaling=rope_scaling, max_position_embeddings=1 << 20)


def _hf_default(head_dim: int, theta: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters(_hf_llama_config(head_dim, theta, None))[0]


def _hf_llama3(head_dim, theta, factor, low, high, original) -> torch.Tensor:
    config = _hf_llama_config(head_dim, theta, {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                                "high_freq_factor": high, "original_max_position_embeddings": original})
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


def _hf_yarn(head_dim, theta, factor, original, beta_fast, beta_slow) -> tuple[torch.Tensor, float]:
    config = _hf_llama_config(head_dim, theta, {"rope_type": "yarn", "factor": factor, "beta_fast": beta_fast,
                                                "original_max_position_embeddings": original, "beta_slow": beta_slow})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


def test_plain_frequencies_are_theta_to_the_minus_2i_over_d_in_float64():
    for head_dim, theta in ((128, 500000.0), (64, 10000.0), (8, 1000000.0)):
        got = rope_frequencies(head_dim, theta)
        assert got.dtype == torch.float64 and got.shape == (head_dim // 2,)
        want = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
        want_hf = _hf_default(head_dim, theta)
        torch.testing.assert_close(got.float(), want_hf, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", LLAMA3, ids=["llama3.1", "llama3.2", "short"])
def test_llama3_frequencies_equal_transformers_in_each_band(case):
    head_dim, theta, factor, low, high, original = case
    got = rope_frequencies(head_dim, theta, (factor, low, high, original))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), _hf_llama3(*case), rtol=1e-6, atol=0)
    # every band is present, so a slip in any of the three rules moves some frequency
    plain = rope_frequencies(head_dim, theta)
    wavelen = 2 * math.pi / plain
    kept, divided = wavelen < original / high, wavelen > original / low
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    assert torch.equal(got[kept], plain[kept]) and torch.allclose(got[divided], plain[divided] / factor, rtol=1e-15)


def _yarn_by_hand(head_dim, theta, factor, original, beta_fast, beta_slow) -> torch.Tensor:
    """arXiv 2309.00071 §3.2 in float64, pair by pair: the ramp runs from channel floor(d(beta_fast)) (at least 0)
    to ceil(d(beta_slow)) (at most head_dim - 1; 0.001 past the start when they meet), d(r) = head_dim ln(L /
    (2 pi r)) / (2 ln theta); f_i = f_i^plain (1 - ramp_i) + f_i^plain / s ramp_i."""
    def channel(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    start, end = max(math.floor(channel(beta_fast)), 0), min(math.ceil(channel(beta_slow)), head_dim - 1)
    end = end + 0.001 if end == start else end
    out = []
    for i in range(head_dim // 2):
        plain, ramp = theta ** (-2 * i / head_dim), min(max((i - start) / (end - start), 0.0), 1.0)
        out.append(plain * (1 - ramp) + plain / factor * ramp)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("case", YARN, ids=YARN_IDS)
def test_yarn_frequencies_and_attention_factor_equal_transformers(case):
    head_dim, theta, factor, original, beta_fast, beta_slow = case
    want, want_factor = _hf_yarn(*case)
    got = yarn_frequencies(head_dim, theta, factor, original, beta_fast, beta_slow)
    assert got.dtype == torch.float64 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, _yarn_by_hand(*case), rtol=1e-13, atol=0)  # float64 all the way
    assert yarn_attention_factor(factor) == pytest.approx(want_factor, rel=1e-12)
    assert yarn_attention_factor(factor) == pytest.approx(0.1 * math.log(factor) + 1, rel=1e-15)  # eq. 22


def test_yarn_attention_factor_is_one_without_extension():
    """sqrt(1/t) = 0.1 ln s + 1 only extends (s > 1); s <= 1 leaves the tables alone (transformers' get_mscale)."""
    from transformers.modeling_rope_utils import yarn_get_mscale

    for factor in (1.0, 0.5, 1.0 + 1e-9, 2.0):
        assert yarn_attention_factor(factor) == pytest.approx(yarn_get_mscale(factor), rel=1e-15)
    assert yarn_attention_factor(1.0) == yarn_attention_factor(0.5) == 1.0


def _tables_oracle(inv_freq: torch.Tensor, max_seq_len: int, attention_factor: float):
    angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return angles.cos() * attention_factor, angles.sin() * attention_factor


@pytest.mark.parametrize("kind", ["plain", "llama3", "yarn", "yarn_attention_factor"])
def test_tables_are_cos_sin_of_position_times_frequency(kind):
    """cos/sin[p, i] = a * cos/sin(p f_i), a YaRN's attention factor (1 otherwise), f transformers' frequencies."""
    seq, head_dim, theta = 48, 64, 10000.0
    kwargs, attention_factor = {}, 1.0
    if kind == "plain":
        inv_freq = _hf_default(head_dim, theta)
    elif kind == "llama3":
        kwargs["scaling"] = LLAMA3[2][2:]
        inv_freq = _hf_llama3(head_dim, theta, *LLAMA3[2][2:])
    else:
        kwargs["yarn"] = (4.0, 16, 32.0, 1.0)
        inv_freq, attention_factor = _hf_yarn(head_dim, theta, 4.0, 16, 32.0, 1.0)
        if kind == "yarn_attention_factor":
            kwargs["attention_factor"] = attention_factor = 0.7  # an explicit factor replaces the default
    cos, sin = precompute_rope(head_dim, seq, theta, **kwargs)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (seq, head_dim // 2)
    want_cos, want_sin = _tables_oracle(inv_freq, seq, attention_factor)
    # transformers' float32 frequencies: at most ~1e-7 relative, times 47 positions
    torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=2e-5)


def test_tables_follow_the_default_dtype_and_the_requested_device():
    """float64 reference mode: tables in float64; the meta device (a model built before materialisation) keeps
    every intermediate on the device asked for (an outer product across devices raises)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cos, sin = precompute_rope(16, 8, 10000.0, yarn=(4.0, 4, 32.0, 1.0))
    finally:
        torch.set_default_dtype(previous)
    assert cos.dtype == sin.dtype == torch.float64
    want_cos, want_sin = _tables_oracle(yarn_frequencies(16, 10000.0, 4.0, 4, 32.0, 1.0), 8, yarn_attention_factor(4.0))
    torch.testing.assert_close(cos, want_cos, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(sin, want_sin, rtol=1e-15, atol=1e-15)
    for kwargs in ({}, {"scaling": (8.0, 1.0, 4.0, 16)}, {"yarn": (4.0, 4, 32.0, 1.0)}):
        cos, sin = precompute_rope(16, 8, 10000.0, device="meta", **kwargs)
        assert cos.device.type == sin.device.type == "meta"
    assert rope_frequencies(16, 10000.0, (8.0, 1.0, 4.0, 16), device="meta").device.type == "meta"
    assert yarn_frequencies(16, 10000.0, 4.0, 4, 32.0, 1.0, device="meta").device.type == "meta"


def _meta_rotation(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Meta's reference: channel pairs (2i, 2i+1) as complex numbers times e^(i angle), in complex128.
    x [B, S, H, D]; angles [S, D/2] or [B, S, D/2]."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())
    rotation = rotation[None, :, None, :] if angles.dim() == 2 else rotation[:, :, None, :]
    return torch.view_as_real(pairs * rotation).flatten(-2)


def test_rotation_equals_metas_complex_product():
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 5, 3, 8  # seq != heads, so a table broadcast over the wrong axis cannot fit
    x = torch.randn(batch, seq, heads, head_dim)
    inv_freq = rope_frequencies(head_dim, 10000.0)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = precompute_rope(head_dim, seq, 10000.0)
    got = apply_rope(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _meta_rotation(x, angles), rtol=0, atol=1e-5)
    # per-sequence positions (RoPE restarting at each packed document): [B, S, D/2] tables
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    angles = positions[..., None].double() * inv_freq
    got = apply_rope(x, angles.cos().float(), angles.sin().float())
    torch.testing.assert_close(got.double(), _meta_rotation(x, angles), rtol=0, atol=1e-5)
    assert torch.equal(got[1], apply_rope(x[1:], cos, sin)[0])  # the second row's positions are 0..4


def test_rotation_of_bf16_runs_in_float32():
    """bf16 queries are rotated in float32 and rounded once: each output is the float64 rotation rounded to
    bf16, to half a bf16 ulp (8 significant bits) plus float32's own error; products rounded to bf16 lose more."""
    torch.manual_seed(1)
    x = torch.randn(4, 64, 2, 16).bfloat16()
    inv_freq = rope_frequencies(16, 10000.0)
    cos, sin = precompute_rope(16, 64, 10000.0)
    got = apply_rope(x, cos, sin)
    assert got.dtype == torch.bfloat16
    want = _meta_rotation(x.double(), torch.arange(64, dtype=torch.float64)[:, None] * inv_freq)
    half_ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)
    bound = half_ulp + want.abs() * 1e-6 + 1e-30
    assert ((got.double() - want).abs() <= bound).all()


DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


@pytest.mark.parametrize("rope_scaling", [None, DEEPSEEK_YARN], ids=["plain", "yarn"])
def test_deepseek_tables_equal_transformers_frequencies_and_attention_factor(rope_scaling):
    """models/deepseek_v3/yarn.py: a DeepSeek-V3 config's tables are a * cos/sin(p f), with f and a (DeepSeek's
    mscale / mscale_all_dim ratio) from transformers' DeepseekV3RotaryEmbedding, over the rotated width only."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from models.deepseek_v3.hf import args_from_config
    from models.deepseek_v3.yarn import deepseek_rope_tables

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=0, kv_lora_rank=20, q_lora_rank=None, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10,
        max_position_embeddings=40, rope_theta=10000.0, rope_scaling=rope_scaling)
    args = args_from_config(config.to_dict())
    rotary = DeepseekV3RotaryEmbedding(config)
    cos, sin = deepseek_rope_tables(args)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (40, 4)
    want_cos, want_sin = _tables_oracle(rotary.inv_freq, 40, rotary.attention_scaling)
    assert (rotary.attention_scaling != 1.0) == (rope_scaling is not None)
    torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=2e-5)
    cos, sin = deepseek_rope_tables(args, device="meta")
    assert cos.device.type == sin.device.type == "meta"
