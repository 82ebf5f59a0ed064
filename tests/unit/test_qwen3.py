"""Qwen3 and Qwen3-MoE (models/qwen3): flavors against transformers' own models, the Hugging Face
adapter (config and weights) against transformers' logits, bitwise round trips, refusals, the
planner's shapes and FLOPs, and the start-up checks. Multi-process parity: tests/integration/test_qwen3_parallel.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

import models  # noqa: E402,F401  (registers the families)
from models.registry import get_model_args, get_model_spec, load_ref  # noqa: E402


# The family's adapters and planner view, through its ModelSpec (as engine/convert/hf.py and
# engine/planner/ reach them).
def _adapter(name: str):
    return get_model_spec(name).get("hf_adapter")


def args_from_hf_config(config: dict, name: str | None = None):
    """(model.name, args) of a config.json, read by the adapter of ``name`` (default: its model_type)."""
    name = name or config["model_type"]
    return name, _adapter(name).args_from_config(config, "config.json")


def hf_config_from_args(name: str, args, **kwargs) -> dict:
    return _adapter(name).config_from_args(args, **kwargs)


def weight_rules(name: str, args):
    return _adapter(name).weight_rules(args)


def to_quadra_state_dict(name: str, args, hf_state: dict) -> dict:
    return {rule.quadra: rule.to_quadra([hf_state[key] for key in rule.hf]) for rule in weight_rules(name, args)}


def to_hf_state_dict(name: str, args, state: dict) -> dict:
    """As transformers' files store it: no ``lm_head.weight`` when tied."""
    out = {}
    for rule in weight_rules(name, args):
        if not (args.tie_embeddings and rule.quadra == "output.weight"):
            out.update(zip(rule.hf, rule.to_hf(state[rule.quadra])))
    return out


def param_shapes(args):
    name = "qwen3_moe" if hasattr(args, "num_experts") else "qwen3"
    return get_model_spec(name).get("param_shapes")(args)


def flops_per_token(args, seq_len: int):
    name = "qwen3_moe" if hasattr(args, "num_experts") else "qwen3"
    return get_model_spec(name).get("flops_per_token")(args, seq_len)

# The published config.json values of the Qwen/Qwen3-* releases (Hugging Face Hub), the fields
# that decide the parameters; all share vocab 151936, head_dim 128, theta 1e6, eps 1e-6.
_SHARED = dict(vocab_size=151936, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
PUBLISHED = {
    ("qwen3", "0.6B"): dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, tie_word_embeddings=True),
    ("qwen3", "1.7B"): dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, tie_word_embeddings=True),
    ("qwen3", "4B"): dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, tie_word_embeddings=True),
    ("qwen3", "8B"): dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, tie_word_embeddings=False),
    ("qwen3", "14B"): dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                           num_key_value_heads=8, tie_word_embeddings=False),
    ("qwen3", "32B"): dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                           num_key_value_heads=8, tie_word_embeddings=False),
    ("qwen3_moe", "30B-A3B"): dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                                   num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False),
    ("qwen3_moe", "235B-A22B"): dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                     num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                     tie_word_embeddings=False),
}
# The sizes the releases are named by (total parameters, tied ones once).
TOTALS = {"0.6B": 596_049_920, "1.7B": 1_720_574_976, "4B": 4_022_468_096, "8B": 8_190_735_360,
          "14B": 14_768_307_200, "32B": 32_762_123_264, "30B-A3B": 30_532_122_624, "235B-A22B": 235_093_634_560}


def _hf_classes(name: str):
    if name == "qwen3":
        return transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM


def _meta_model(name: str, args):
    with torch.device("meta"):
        return load_ref(get_model_spec(name).model_cls)(args)


@pytest.mark.parametrize("name, flavor", list(PUBLISHED))
def test_flavor_parameter_counts_equal_transformers(name, flavor):
    """Each published flavor has the parameters of transformers' model of the published config, and
    exports to that config."""
    published = {**_SHARED, **PUBLISHED[(name, flavor)]}
    config_cls, model_cls = _hf_classes(name)
    with torch.device("meta"):
        hf_model = model_cls(config_cls(**published))
    want = sum(p.numel() for p in hf_model.parameters())  # tied lm_head once
    args = get_model_args(name, flavor)
    got = sum(p.numel() for p in _meta_model(name, args).parameters())
    assert got == want == TOTALS[flavor], (got, want)
    exported = hf_config_from_args(name, args, dtype="bfloat16", bos_id=None, eos_id=None)
    assert {key: exported[key] for key in published} == published


def test_flavors_keep_what_makes_qwen3():
    for name in ("qwen3", "qwen3_moe"):
        for flavor, args in get_model_spec(name).flavors.items():
            assert args.qk_norm and args.rope_theta == 1e6 and args.norm_eps == 1e-6, (name, flavor)
            if flavor.startswith("debugmodel"):
                assert args.vocab_size == 4096 and args.head_dim != args.dim // args.n_heads, (name, flavor)
            if name == "qwen3_moe":
                assert (args.score_func, args.route_norm, args.n_shared_experts, args.n_dense_layers) == \
                    ("softmax", True, 0, 0)


# ---------------------------------------------------------------- Hugging Face adapter
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
HF_MODELS = {
    # head_dim 16 with 4 heads on 48 (not 12), untied / tied, and the MoE with and without renormalization.
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                                    norm_topk_prob=True, router_aux_loss_coef=0.001)),
    "qwen3_moe_unnormalized": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                                                 norm_topk_prob=False)),
}


def _random_hf_model(kind: str, extra: dict, seed: int):
    config_cls, model_cls = _hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SMALL, **extra))
    with torch.no_grad():  # random norms too, so that a wrong norm permutation or swap would show
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (config.json dict, the files' state dict, HF model)}: each saved by transformers."""
    from safetensors.torch import load_file

    out = {}
    for seed, (name, (kind, extra)) in enumerate(HF_MODELS.items()):
        model = _random_hf_model(kind, extra, seed)
        folder = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(folder)
        config = json.load(open(os.path.join(folder, "config.json")))
        out[name] = (config, load_file(os.path.join(folder, "model.safetensors")), model)
    return out


def _quadra_from_hf(config: dict, hf_state: dict):
    name, args = args_from_hf_config(config)
    model = _meta_model(name, args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device="cpu")
    model.load_state_dict(to_quadra_state_dict(name, args, hf_state), strict=True)
    return name, args, model.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hf_name", list(HF_MODELS))
def test_converted_weights_give_transformers_logits(saved, hf_name):
    config, hf_state, hf_model = saved[hf_name]
    name, args, model = _quadra_from_hf(config, hf_state)
    assert name == HF_MODELS[hf_name][0] and args.head_dim == 16 and args.dim // args.n_heads == 12
    assert args.tie_embeddings == config["tie_word_embeddings"]
    if name == "qwen3_moe":
        assert (args.num_experts, args.top_k, args.moe_inter_dim) == (8, 3, 24)
        assert args.route_norm == config["norm_topk_prob"]
    tokens = _tokens()
    with torch.no_grad():
        want, got = hf_model(tokens).logits, model(tokens)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    assert want.abs().max().item() > 0.1  # logits of a size where 1e-5 means something


@pytest.mark.parametrize("hf_name", list(HF_MODELS))
def test_hf_to_quadra_to_hf_is_bitwise(saved, hf_name):
    config, hf_state, _ = saved[hf_name]
    name, args = args_from_hf_config(config)
    back = to_hf_state_dict(name, args, to_quadra_state_dict(name, args, hf_state))
    assert back.keys() == hf_state.keys()
    unequal = [k for k in hf_state if back[k].dtype != hf_state[k].dtype or not torch.equal(back[k], hf_state[k])]
    assert not unequal, unequal[:3]


@pytest.mark.parametrize("hf_name", list(HF_MODELS))
def test_exported_config_and_weights_reload_in_transformers(saved, tmp_path, hf_name):
    """Quadra -> config.json + safetensors -> transformers' AutoModelForCausalLM: Quadra's logits."""
    from safetensors.torch import save_file

    config, hf_state, _ = saved[hf_name]
    name, args, model = _quadra_from_hf(config, hf_state)
    exported = hf_config_from_args(name, args, dtype="float32", bos_id=1, eos_id=2)
    assert args_from_hf_config(exported) == (name, args)
    json.dump(exported, open(tmp_path / "config.json", "w"))
    state = to_hf_state_dict(name, args, {k: v.contiguous() for k, v in model.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(reloaded).__name__ == exported["architectures"][0]
    tokens = _tokens(1)
    with torch.no_grad():
        assert (reloaded(tokens).logits - model(tokens)).abs().max().item() < 1e-5


def test_weight_rules_cover_the_model():
    for name in ("qwen3", "qwen3_moe"):
        for tie in (False, True):
            args = get_model_args(name, "debugmodel_tiny")
            args.tie_embeddings = tie
            rules = {rule.quadra for rule in weight_rules(name, args)}
            assert rules == set(_meta_model(name, args).state_dict()), name


@pytest.mark.parametrize("change, fragment", [
    ({"model_type": "llama"}, "model_type = 'llama' is not a Qwen3 model"),
    ({"use_sliding_window": True}, "use_sliding_window = true"),
    ({"attention_bias": True}, "attention_bias = true"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "RoPE scaling 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}}, "attention_factor is set"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers = [0]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_unsupported_configs_are_refused_naming_the_field(saved, change, fragment):
    config = {**saved["qwen3_moe"][0], **change}
    if config["num_hidden_layers"] is None:
        del config["num_hidden_layers"]
    with pytest.raises(ValueError, match="^config.json: ") as error:
        args_from_hf_config(config, "qwen3_moe")
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_models_without_a_qwen3_layout_are_refused():
    moe = get_model_args("qwen3_moe", "debugmodel")
    for field, value in (("score_func", "sigmoid"), ("n_shared_experts", 1), ("load_balance_coeff", 1e-3)):
        changed = get_model_args("qwen3_moe", "debugmodel")
        setattr(changed, field, value)
        with pytest.raises(ValueError, match=f"{field} = "):
            hf_config_from_args("qwen3_moe", changed, dtype="float32", bos_id=None, eos_id=None)
    moe.n_dense_layers = 1
    with pytest.raises(ValueError, match="no shared experts and no dense layers"):
        weight_rules("qwen3_moe", moe)
    dense = get_model_args("qwen3", "debugmodel")
    dense.qk_norm = False
    with pytest.raises(ValueError, match="qk_norm = False"):
        hf_config_from_args("qwen3", dense, dtype="float32", bos_id=None, eos_id=None)


# ---------------------------------------------------------------- planner shapes, FLOPs, checks
@pytest.mark.parametrize("name, flavor", [("qwen3", "debugmodel_tiny"), ("qwen3", "0.6B"), ("qwen3", "8B"),
                                          ("qwen3_moe", "debugmodel"), ("qwen3_moe", "30B-A3B")])
def test_planner_shapes_and_flops_equal_the_model(name, flavor):
    args = get_model_args(name, flavor)
    model = _meta_model(name, args)
    assert [(s.name, s.shape) for s in param_shapes(args)] == \
        [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_flops_use_head_dim_not_dim_over_heads():
    """Qwen3-0.6B at 4096 tokens: the attention term counts 16 heads of 128 (2048 channels), twice
    what dim / n_heads = 64 would give."""
    args = get_model_args("qwen3", "0.6B")
    nonembedding = 596_049_920  # tied: the shared matrix does the output matmul
    assert flops_per_token(args, 4096) == 6 * nonembedding + 12 * 28 * 16 * 128 * 4096


def test_start_up_checks_name_setting_value_and_fix():
    from types import SimpleNamespace

    spec = get_model_spec("qwen3")
    cfg = SimpleNamespace(tp=1, ep=2, cp=1, sequence_parallel=True, loss_parallel=True, async_tp=False)
    kwargs = dict(seq_len=64, device_type="cpu", compile_enabled=False)
    with pytest.raises(ValueError, match='parallelism.ep = 2: model.name = "qwen3" is dense'):
        spec.validate_parallelism_fn(get_model_args("qwen3", "debugmodel_tiny"), cfg, **kwargs)
    cfg.ep, cfg.tp = 1, 8
    with pytest.raises(ValueError, match="parallelism.tp = 8 does not divide the model's n_kv_heads = 4"):
        spec.validate_parallelism_fn(get_model_args("qwen3", "debugmodel_tiny"), cfg, **kwargs)
    moe = get_model_spec("qwen3_moe")
    cfg.tp, cfg.ep = 1, 3
    with pytest.raises(ValueError, match="parallelism.ep = 3"):
        moe.validate_parallelism_fn(get_model_args("qwen3_moe", "debugmodel_tiny"), cfg, **kwargs)
    cfg.ep = 2
    moe.validate_parallelism_fn(get_model_args("qwen3_moe", "debugmodel_tiny"), cfg, seq_len=64,
                                device_type="cpu", compile_enabled=True)  # static parts compiled, routing eager
    cfg.tp = 4
    moe.validate_parallelism_fn(get_model_args("qwen3_moe", "debugmodel_tiny"), cfg, **kwargs)


@pytest.mark.parametrize("name, flavor", [("llama", "debugmodel_tiny"), ("moe", "debugmodel_mixtral_tiny")])
def test_llama_and_mixtral_exports_refuse_qk_norm(name, flavor):
    """Hugging Face's Llama / Mixtral would load such a model silently without its QK-norm weights."""
    args = get_model_args(name, flavor)
    args.qk_norm = True
    with pytest.raises(ValueError, match="qk_norm = True; Hugging Face's .* has no QK-norm"):
        _adapter(name).config_from_args(args, dtype="float32", bos_id=None, eos_id=None)


def test_yarn_is_validated_and_named_past_the_trained_length():
    """Qwen3's long-context YaRN (models/common/rope.py): its settings are checked, and a run past the
    trained length names it in its one warning (models/registry.py ``long_context_warning``)."""
    import dataclasses

    from models.resolve import long_context_warning

    base = get_model_args("qwen3", "debugmodel_tiny")
    yarn = dataclasses.replace(base, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=512)
    yarn.validate()
    line = long_context_warning(yarn, 2 * base.max_seq_len, "qwen3/debugmodel_tiny")
    assert "RoPE frequencies (of every position): YaRN (factor 4, original_max_seq_len 512, beta_fast 32, beta_slow 1)" in line, line
    for bad in (dict(rope_scaling_factor=0.5), dict(rope_yarn_beta_fast=0.5), dict(rope_scaling="ntk")):
        with pytest.raises(ValueError, match="rope_scaling|yarn RoPE scaling"):
            dataclasses.replace(yarn, **bad).validate()
