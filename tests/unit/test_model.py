"""Tests for the model registry and the LLaMA-3 model (models/)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from models import ModelSpec, get_model_args, get_model_spec, register_model_spec
from models.registry import load_ref
from models.llama import LlamaModelArgs, Transformer
from models.common.args import ffn_hidden_dim
from models.common.shapes import llama_flops_per_token
from models.common.parallelize import LLAMA_PLAN


def tiny_args(**overrides) -> LlamaModelArgs:
    """6 layers of width 64 with GQA (4 query heads, 2 kv heads): fast on CPU."""
    base = dict(
        dim=64, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
        rope_theta=10000.0, max_seq_len=64,
    )
    base.update(overrides)
    return LlamaModelArgs(**base)


def build(args: LlamaModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def meta_build(args: LlamaModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def assert_same_weights(part: torch.nn.Module, full: torch.nn.Module) -> None:
    full_sd = full.state_dict()
    part_sd = part.state_dict()
    assert part_sd, "part has no parameters"
    for name, tensor in part_sd.items():
        assert torch.equal(tensor, full_sd[name]), name


# ---------------------------------------------------------------- shapes and counts


@pytest.mark.parametrize("flavor_args", ["debugmodel", "tiny"])
def test_forward_shapes(flavor_args):
    args = get_model_args("llama", "debugmodel") if flavor_args == "debugmodel" else tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, args.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_ffn_hidden_dim_matches_released_models():
    assert ffn_hidden_dim(256, 256, None) == 768  # debugmodel
    assert ffn_hidden_dim(2048, 256, 1.5) == 8192  # Llama 3.2 1B
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336  # 8B
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672  # 70B
    assert ffn_hidden_dim(16384, 4096, 1.2) == 53248  # 405B


def _nparams(model) -> int:
    """Unique parameters of ``model`` (``parameters()`` yields a tied matrix once)."""
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor,expected", [("8B", 8_030_261_248), ("70B", 70_553_706_496)])
def test_param_counts_on_meta(flavor, expected):
    args = get_model_args("llama", flavor)
    model = meta_build(args)
    assert _nparams(model) == expected


def test_debugmodel_param_count_matches_formula():
    a = get_model_args("llama", "debugmodel")
    kv_dim = a.kv_heads * a.head_dim
    per_layer = (
        a.dim * a.dim * 2  # wq, wo
        + a.dim * kv_dim * 2  # wk, wv
        + 3 * a.dim * a.ffn_hidden_dim  # w1, w2, w3
        + 2 * a.dim  # attention_norm, ffn_norm
    )
    expected = a.n_layers * per_layer + 2 * a.vocab_size * a.dim + a.dim
    nparams = _nparams(meta_build(a))
    print(f"debugmodel parameters: {nparams:,}")
    assert nparams == expected == 6_819_072


def test_flops_8B_seq_8192_by_hand():
    args = get_model_args("llama", "8B")
    flops = llama_flops_per_token(args, 8192)
    non_embedding = 8_030_261_248 - 128256 * 4096  # the lookup table does no FLOPs
    attention = 12 * 32 * 32 * 128 * 8192  # 12 * L * H * head_dim * seq_len
    assert flops == 6 * non_embedding + attention == 57_914_449_920
    with pytest.raises(ValueError, match="seq_len"):
        llama_flops_per_token(tiny_args(), 0)


# ---------------------------------------------------------------- semantics


def test_causality():
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    t = 10
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    """A GQA model equals the MHA model whose k/v heads are the GQA heads repeated per group."""
    gqa_args = tiny_args(n_layers=2, n_heads=4, n_kv_heads=2)
    mha_args = dataclasses.replace(gqa_args, n_kv_heads=None)
    gqa, mha = build(gqa_args), build(mha_args)
    mha_sd = gqa.state_dict()
    n_rep, hd = gqa_args.n_heads // gqa_args.kv_heads, gqa_args.head_dim
    for name, w in list(mha_sd.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            mha_sd[name] = w.view(-1, hd, gqa_args.dim).repeat_interleave(n_rep, 0).reshape(-1, gqa_args.dim)
    mha.load_state_dict(mha_sd)
    tokens = torch.randint(0, gqa_args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)
    assert mha.layers["0"].attention.wk.weight.shape == (64, 64)
    assert gqa.layers["0"].attention.wk.weight.shape == (32, 64)


def test_positions_default_and_max_seq_len():
    args = tiny_args(n_layers=2)
    model = build(args)
    with torch.no_grad():  # sharpen attention (std 0.02 -> 0.5) so that positions matter visibly
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(25)
            layer.attention.wk.weight.mul_(25)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions=torch.arange(16)), model(tokens), rtol=0, atol=0)
        reference = model(tokens)
        # RoPE scores depend only on position differences: a uniform shift changes ~nothing...
        shifted = model(tokens, positions=torch.arange(16) + 5)
        # ...while a gap after position 7 changes every later position's output.
        gapped = model(tokens, positions=torch.cat([torch.arange(8), torch.arange(8) + 30]))
    torch.testing.assert_close(shifted, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gapped[:, :8], reference[:, :8], rtol=0, atol=1e-6)
    assert (gapped[:, 8:] - reference[:, 8:]).abs().amax().item() > 1e-2
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        model(tokens, positions=torch.arange(8))


def test_forward_rejects_wrong_input_kind():
    args = tiny_args(n_layers=2)
    model = build(args)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.randn(1, 8, args.dim))
    model.tok_embeddings = None
    with pytest.raises(ValueError, match="hidden state"):
        model(torch.zeros(1, 8, dtype=torch.long))


# ---------------------------------------------------------------- initialization


def test_init_is_deterministic_and_independent_of_global_rng():
    args = tiny_args()
    torch.manual_seed(1)
    a = build(args, seed=3)
    torch.manual_seed(2)
    b = build(args, seed=3)
    assert_same_weights(a, b)
    c = build(args, seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    # Different layers draw different values even with equal shapes and std.
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_init_statistics_follow_torchtitan_scheme():
    args = get_model_args("llama", "debugmodel")
    model = build(args)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for i in (0, 5):  # depth_init: 0.02 / sqrt(2 (i + 1))
        std = model.layers[str(i)].feed_forward.w2.weight.std().item()
        assert std == pytest.approx(0.02 / math.sqrt(2 * (i + 1)), rel=0.05)
    out = model.output.weight
    assert out.abs().max().item() <= 3 * args.dim**-0.5 + 1e-6
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    flat = build(dataclasses.replace(args, depth_init=False))
    assert flat.layers["0"].weight_init_std == flat.layers["5"].weight_init_std == 0.02 / math.sqrt(12)


def test_partial_model_gets_full_model_weights():
    args = tiny_args()
    full = build(args, seed=7)
    part = meta_build(args)
    part.tok_embeddings = part.norm = part.output = None
    for key in ("0", "1", "2", "5"):
        del part.layers[key]
    part.to_empty(device="cpu")
    part.init_weights(seed=7)
    assert sorted(part.layers.keys()) == ["3", "4"]
    assert_same_weights(part, full)


def test_meta_build_to_empty_init_is_complete():
    args = tiny_args()
    reference = build(args, seed=0)
    model = meta_build(args)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert_same_weights(model, reference)
    assert torch.equal(model.rope_cos, reference.rope_cos)
    assert torch.equal(model.rope_sin, reference.rope_sin)
    logits = model(torch.randint(0, args.vocab_size, (2, 16)))
    assert torch.isfinite(logits).all()
    assert "rope_cos" not in model.state_dict()  # non-persistent: recomputed, never checkpointed


def test_tied_embeddings_share_storage_and_count_once():
    args = tiny_args(tie_embeddings=True)
    untied_n, untied_flops = _nparams(meta_build(tiny_args())), llama_flops_per_token(tiny_args(), 32)
    model = meta_build(args)
    model.to_empty(device="cpu")  # must not untie the two modules
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    nparams, flops = _nparams(model), llama_flops_per_token(args, 32)
    assert nparams == untied_n - args.vocab_size * args.dim
    # The shared matrix still does the output matmul, so FLOPs equal the untied model's.
    assert flops == untied_flops
    assert torch.isfinite(model(torch.randint(0, args.vocab_size, (1, 8)))).all()
    stage = meta_build(args)
    stage.output = None
    stage.to_empty(device="cpu")
    with pytest.raises(ValueError, match="tie_embeddings"):
        stage.init_weights()


def test_pipeline_stage_chain_equals_full_model():
    args = tiny_args()
    full = build(args, seed=11)
    first, second = meta_build(args), meta_build(args)
    first.norm = first.output = None
    second.tok_embeddings = None
    for key in ("3", "4", "5"):
        del first.layers[key]
    for key in ("0", "1", "2"):
        del second.layers[key]
    for part in (first, second):
        part.to_empty(device="cpu")
        part.init_weights(seed=11)
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 20, args.dim)
        torch.testing.assert_close(second(hidden), full(tokens), rtol=0, atol=0)
    assert sum(_nparams(p) for p in (first, second)) == _nparams(full)


# ---------------------------------------------------------------- validation and registry


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(dim=65), "dim=65 is not divisible by n_heads"),
        (dict(n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
        (dict(n_layers=0), "n_layers"),
        (dict(dim=12, n_heads=4, n_kv_heads=None), "head_dim"),
        (dict(ffn_dim_multiplier=-1.0), "ffn_dim_multiplier"),
    ],
)
def test_validate_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        Transformer(tiny_args(**overrides))


def test_registry_lookup_and_errors():
    spec = get_model_spec("llama")
    assert load_ref(spec.model_cls) is Transformer and load_ref(spec.parallelize_plan) is LLAMA_PLAN
    assert {"debugmodel", "1B", "8B", "70B", "405B"} <= set(spec.flavors)
    with pytest.raises(ValueError, match="already registered"):
        register_model_spec(ModelSpec("llama", Transformer, {"x": tiny_args()}, None))
    with pytest.raises(ValueError, match=r"model\.name='lama'.*'llama'"):
        get_model_spec("lama")
    with pytest.raises(ValueError, match=r"model\.flavor='9B'.*'8B'"):
        get_model_args("llama", "9B")
    args = get_model_args("llama", "debugmodel")
    args.vocab_size = 1
    assert get_model_args("llama", "debugmodel").vocab_size == 4096  # a copy, registry untouched
    assert copy.deepcopy(spec.flavors["8B"]).max_seq_len == 131072
