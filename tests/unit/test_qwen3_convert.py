"""scripts/convert_checkpoint.py ``from-hf`` / ``to-hf`` for Qwen3 and Qwen3-MoE checkpoints saved by
transformers: the converted model's logits equal transformers' (fp32, 1e-5), the printed next step
names the family, and HF -> DCP -> HF gives back every stored tensor bitwise (bf16 files in several
shards, tied and untied heads, QK-norm weights, per-expert matrices)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

from tests.integration.test_hf_interop import quadra_model  # noqa: E402
from tests.training_utils import REPO  # noqa: E402

VOCAB = 320
# head_dim 16 on a width of 48 with 4 heads (48 / 4 = 12): a head width apart from dim / n_heads.
SMALL = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
MODELS = {  # name: (model.name, config extras, stored dtype)
    "qwen3_tied_bf16": ("qwen3", dict(tie_word_embeddings=True), torch.bfloat16),
    "qwen3_untied": ("qwen3", dict(tie_word_embeddings=False), torch.float32),
    "qwen3_moe": ("qwen3_moe", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=24, norm_topk_prob=True), torch.float32),
}


def _hf_model(kind: str, extra: dict, seed: int):
    if kind == "qwen3":
        config, model_cls = transformers.Qwen3Config(**SMALL, **extra), transformers.Qwen3ForCausalLM
    else:
        config, model_cls = transformers.Qwen3MoeConfig(**SMALL, **extra), transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random norms too (QK-norm included), so a wrong permutation would show
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.1)
    return model.eval()


def _script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(REPO, "scripts",
                                                                                    "convert_checkpoint.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _stored(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_from_hf_then_to_hf_is_bitwise_and_gives_transformers_logits(tmp_path, capsys, name):
    kind, extra, dtype = MODELS[name]
    model = _hf_model(kind, extra, seed=len(name))
    with torch.no_grad():  # the fp32 reference holds the values the file stores
        for param in model.parameters():
            param.copy_(param.to(dtype))
    hf_dir, dcp_dir, back_dir = str(tmp_path / "hf"), str(tmp_path / "dcp"), str(tmp_path / "back")
    copy.deepcopy(model).to(dtype).save_pretrained(hf_dir, max_shard_size="40KB")
    assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 1  # sharded
    script = _script()

    assert script.main(["from-hf", hf_dir, dcp_dir]) == 0
    assert f"--model.name {kind}" in capsys.readouterr().out
    quadra = quadra_model(dcp_dir)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens).logits, quadra(tokens)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.1

    args = ["to-hf", dcp_dir, back_dir] + (["--dtype", "bfloat16"] if dtype == torch.bfloat16 else [])
    assert script.main(args) == 0
    original, back = _stored(hf_dir), _stored(back_dir)
    assert back.keys() == original.keys()
    unequal = [k for k in original if back[k].dtype != original[k].dtype or not torch.equal(back[k], original[k])]
    assert not unequal, unequal[:3]
    config = json.load(open(os.path.join(back_dir, "config.json")))
    assert config["model_type"] == kind and config["head_dim"] == 16
    assert config["tie_word_embeddings"] == extra["tie_word_embeddings"]
