"""The deepseek_v3 family against transformers' DeepseekV3ForCausalLM: flavor parameter counts
(meta device, exact), and scripts/convert_checkpoint.py from-hf / to-hf on random tiny models: the
converted model's logits equal transformers' (fp32, 1e-5) with and without the query latent, with
YaRN (mscale != mscale_all_dim, so both the cos/sin factor and the softmax scale count), group-limited
routing and a non-zero routing bias; HF -> DCP -> HF is bitwise."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

from models.deepseek_v3.flavors import deepseek_v3_flavors  # noqa: E402
from models.deepseek_v3.hf import config_from_args  # noqa: E402
from tests.integration.test_hf_interop import quadra_model  # noqa: E402
from tests.unit.test_qwen3_convert import _script, _stored  # noqa: E402

VOCAB = 320
SMALL = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
             n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
MODELS = {  # name: config extras
    "qlora_yarn": dict(q_lora_rank=16, rope_scaling=YARN),
    "no_qlora": dict(q_lora_rank=None),
}


def _hf_model(extra: dict, seed: int):
    return random_hf_model(transformers.DeepseekV3Config(**SMALL, **extra), seed)


def random_hf_model(config, seed: int):
    """transformers' DeepseekV3ForCausalLM of ``config`` in eval mode with random weights, random norms
    and a random routing bias (seeded), so a wrong mapping of any of them shows."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # random norms and routing bias too, so a wrong mapping would show
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(0.0, 0.1)
    return model.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_from_hf_then_to_hf_is_bitwise_and_gives_transformers_logits(tmp_path, capsys, name):
    model = _hf_model(MODELS[name], seed=len(name))
    hf_dir, dcp_dir, back_dir = str(tmp_path / "hf"), str(tmp_path / "dcp"), str(tmp_path / "back")
    copy.deepcopy(model).save_pretrained(hf_dir)
    script = _script()
    assert script.main(["from-hf", hf_dir, dcp_dir]) == 0
    assert "--model.name deepseek_v3" in capsys.readouterr().out
    quadra = quadra_model(dcp_dir)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens).logits, quadra(tokens)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.1

    assert script.main(["to-hf", dcp_dir, back_dir]) == 0
    original, back = _stored(hf_dir), _stored(back_dir)
    assert back.keys() == original.keys()
    unequal = [k for k in original if back[k].dtype != original[k].dtype or not torch.equal(back[k], original[k])]
    assert not unequal, unequal[:3]
    config = json.load(open(os.path.join(back_dir, "config.json")))
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] == MODELS[name]["q_lora_rank"]


# (total, active) parameters; active = all but the routed experts a token does not use.
COUNTS = {"671B": (671_026_404_352, 37_552_282_624), "16B": (15_960_108_544, 2_914_774_528),
          "debugmodel": (704_128, 630_400), "debugmodel_noqlora": (707_104, 633_376)}


@pytest.mark.parametrize("flavor", list(COUNTS))
def test_flavor_parameter_counts_equal_transformers(flavor):
    from models.deepseek_v3.model import DeepseekV3Transformer

    args = deepseek_v3_flavors[flavor]
    config = config_from_args(args, dtype="float32", bos_id=None, eos_id=None)
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
        ours = DeepseekV3Transformer(args)
    want = sum(p.numel() for p in theirs.parameters())
    assert args.count_params(ours) == COUNTS[flavor]
    assert COUNTS[flavor][0] == want


def test_yarn_frequencies_and_attention_factor_equal_transformers():
    """models/deepseek_v3/yarn.py against transformers' "yarn" RoPE initialisation (float32 there)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.deepseek_v3.hf import args_from_config
    from models.deepseek_v3.yarn import yarn_frequencies

    config = transformers.DeepseekV3Config(**SMALL, q_lora_rank=None, rope_scaling=YARN)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    args = args_from_config(config.to_dict())
    got = yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling_factor,
                           args.rope_original_max_seq_len, args.rope_yarn_beta_fast, args.rope_yarn_beta_slow)
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    assert not torch.allclose(got, yarn_frequencies(8, 10000.0, 1.0, 16, 32, 1))  # the scaling moves them
    assert args.rope_attention_factor == pytest.approx(want_factor, rel=1e-12) and want_factor != 1.0


@pytest.mark.parametrize("change, message", [
    (dict(n_group=3), "n_group must divide num_experts"),
    (dict(topk_group=1, n_group=4, top_k=3), "exceeds the experts of topk_group"),
    (dict(qk_nope_head_dim=15, qk_rope_head_dim=7), "qk_rope_head_dim=7 is odd"),
    (dict(n_kv_heads=2), "n_kv_heads=2"),
    (dict(rope_scaling="llama3"), "choose \"none\" or \"yarn\""),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers=-1 must be an integer >= 0"),
    (dict(q_lora_rank=-1), "q_lora_rank=-1"),
])
def test_bad_arguments_are_refused_in_one_line(change, message):
    import dataclasses

    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        dataclasses.replace(deepseek_v3_flavors["debugmodel"], **change).validate()
    assert "\n" not in str(error.value)


def test_tensor_parallel_degree_must_split_the_heads():
    from engine.config import load_config
    from models.registry import get_model_spec
    from parallelisms.checks import TensorParallelError
    from tests.training_utils import base_args

    cfg = load_config(base_args("/tmp/unused", {"model.name": "deepseek_v3", "model.flavor": "debugmodel",
                                                "parallelism.tp": 8, "parallelism.dp_shard": 1}))
    with pytest.raises(TensorParallelError, match="n_heads"):
        get_model_spec("deepseek_v3").validate_parallelism_fn(deepseek_v3_flavors["debugmodel"], cfg.parallelism,
                                                              seq_len=32, device_type="cpu", compile_enabled=False)


def test_compile_is_accepted_and_compiles_the_mtp_blocks_static_parts():
    """``compile.enable`` passes the start-up checks; :func:`apply_compile` compiles the dense block
    whole and, in every MoE block, the main ones and the multi-token-prediction depths' alike, the
    MLA, the group-limited router and the shared experts (training parity: tests/integration/test_deepseek_v3_parallel.py)."""
    from types import SimpleNamespace

    from models.registry import get_model_spec
    from models.deepseek_v3.model import DeepseekV3Transformer
    from parallelisms.compile import apply_compile

    args = deepseek_v3_flavors["debugmodel_mtp"]
    cfg = SimpleNamespace(tp=1, ep=2, cp=1, sequence_parallel=True, loss_parallel=True, async_tp=False)
    get_model_spec("deepseek_v3").validate_parallelism_fn(args, cfg, seq_len=32, device_type="cpu",
                                                          compile_enabled=True)
    model = DeepseekV3Transformer(args)
    assert apply_compile(model, backend="aot_eager") == 1 + 3 * 2 + 3 * 2  # dense block; 2 MoE + 2 MTP blocks
    compiled = {name for name, module in model.named_modules() if module._compiled_call_impl is not None}
    for prefix in ("layers.1", "layers.2", "mtp.0.block", "mtp.1.block"):
        assert {f"{prefix}.attention", f"{prefix}.feed_forward.router",
                f"{prefix}.feed_forward.shared_experts"} <= compiled, (prefix, sorted(compiled))
    assert "layers.0" in compiled and "mtp.0.eh_proj" not in compiled
