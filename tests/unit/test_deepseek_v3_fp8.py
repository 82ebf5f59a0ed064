"""scripts/convert_checkpoint.py from-hf on a DeepSeek-V3 checkpoint stored the way DeepSeek publishes
it (README_WEIGHTS.md of deepseek-ai/DeepSeek-V3, "FP8 Weight Documentation"): the linear layers'
weights in ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per 128x128 block, and config.json's
``quantization_config``. A tiny random transformers model whose widths (160, 200, 136) leave partial
blocks at the edges is quantized here, written, and imported: every imported weight equals the
dequantization of the stored FP8 and scales exactly, the Quadra model's logits equal transformers'
model loaded with the same dequantized weights (fp32, 1e-5), to-hf writes the unquantized format,
and another format is refused in one line."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

from tests.integration.test_hf_interop import quadra_model  # noqa: E402
from tests.unit.test_deepseek_v3 import random_hf_model  # noqa: E402
from tests.unit.test_qwen3_convert import _script, _stored  # noqa: E402

VOCAB, BLOCK = 256, 128
# hidden 160, q latent 136, FFN 200, experts 136: every quantized matrix has a partial block at an edge.
TINY = dict(vocab_size=VOCAB, hidden_size=160, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=200, moe_intermediate_size=136, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, q_lora_rank=136, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# The matrices DeepSeek's checkpoint stores in FP8 (its inference/model.py builds them as ``Linear``):
# attention and MLP projections, shared experts and routed experts; not the embedding, head, norms or router.
QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")


def _quantized(name: str) -> bool:
    return name.endswith(QUANTIZED) and ".layers." in name


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale_inv [ceil(rows/128), ceil(cols/128)]): each 128x128 block, zero-padded at
    the edges, scaled so its largest magnitude is e4m3's 448 (DeepSeek's README_WEIGHTS.md)."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(grid[0], BLOCK, grid[1], BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    fp8 = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return fp8.contiguous(), scale.float().contiguous()


def dequantize(fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The test's own reading: element (i, j) times the scale of block (i // 128, j // 128)."""
    rows, cols = fp8.shape
    rows_of, cols_of = torch.arange(rows) // BLOCK, torch.arange(cols) // BLOCK
    return fp8.float() * scale_inv[rows_of[:, None], cols_of[None, :]]


def write_fp8_checkpoint(tmp_path, seed: int = 3) -> tuple[str, dict, dict]:
    """A tiny DeepSeek-V3 saved by transformers, its projections rewritten as FP8 + scale_inv.

    Returns (folder, stored tensors, dequantized tensors under the stored names).
    """
    from safetensors.torch import save_file

    model = random_hf_model(transformers.DeepseekV3Config(**TINY), seed)
    plain = str(tmp_path / "plain")
    copy.deepcopy(model).save_pretrained(plain)
    tensors = _stored(plain)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if _quantized(name):
            fp8, scale = quantize(tensor)
            stored[name], stored[name + "_scale_inv"] = fp8, scale
            dequantized[name] = dequantize(fp8, scale)
        else:
            stored[name] = dequantized[name] = tensor
    folder = str(tmp_path / "fp8")
    os.makedirs(folder)
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(plain, "config.json")))
    config["quantization_config"] = dict(FP8_CONFIG)
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder, stored, dequantized


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(folder, stored tensors, dequantized tensors), written once for the module."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def _reference_model(folder: str, dequantized: dict, tmp_path):
    """transformers' DeepseekV3ForCausalLM loaded (float32) from the dequantized weights, no quantization."""
    from safetensors.torch import save_file

    plain = str(tmp_path / "dequantized")
    os.makedirs(plain)
    save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(folder, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(plain, "config.json"), "w"))
    return transformers.DeepseekV3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()


def test_fp8_import_is_the_dequantized_model_and_exports_unquantized(fp8_checkpoint, tmp_path, capsys):
    from engine.checkpoint import files
    from models.deepseek_v3.hf import weight_rules
    from models.resolve import args_from_record

    folder, stored, dequantized = fp8_checkpoint
    fp8 = [v for v in stored.values() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 28 and all(v.shape[0] % BLOCK or v.shape[1] % BLOCK for v in fp8)  # partial edge blocks
    assert sum(max(v.shape) > BLOCK for v in fp8) == 26  # and a full block beside them (all but kv_b_proj)
    dcp_dir, back_dir = str(tmp_path / "dcp"), str(tmp_path / "back")
    script = _script()
    assert script.main(["from-hf", folder, dcp_dir]) == 0
    assert "dequantized 28 FP8 weights (128x128 block scales) to float32" in capsys.readouterr().out

    quadra = quadra_model(dcp_dir)
    state = quadra.state_dict()
    _, args = args_from_record(files.read_marker(dcp_dir)["model"], dcp_dir)
    unequal = []
    for rule in weight_rules(args):
        want = rule.to_quadra([dequantized[key] for key in rule.hf]).to(torch.float32)
        if state[rule.quadra].dtype != torch.float32 or not torch.equal(state[rule.quadra], want):
            unequal.append(rule.quadra)
    assert not unequal, unequal[:3]

    reference = _reference_model(folder, dequantized, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(tokens).logits, quadra(tokens)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.1

    assert script.main(["to-hf", dcp_dir, back_dir]) == 0
    assert "written unquantized (float32, no quantization_config in config.json)" in capsys.readouterr().out
    back = _stored(back_dir)
    assert back.keys() == dequantized.keys()  # no scale_inv
    unequal = [k for k in back if back[k].dtype != torch.float32 or not torch.equal(back[k], dequantized[k])]
    assert not unequal, unequal[:3]
    assert "quantization_config" not in json.load(open(os.path.join(back_dir, "config.json")))


def _refusal(folder: str, tmp_path, capsys) -> str:
    assert _script().main(["from-hf", folder, str(tmp_path / "dcp")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "dcp"), err
    return err


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quantization_config.quant_method = 'awq'; from-hf reads only quant_method 'fp8'"),
    ({"weight_block_size": [64, 64]}, "quantization_config.weight_block_size = [64, 64]; from-hf reads only "
                                      "[128, 128]"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size = None"),
    ({"fmt": "e5m2"}, "quantization_config.fmt = 'e5m2'; from-hf reads only fmt 'e4m3'"),
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme = 'static'"),
])
def test_another_quantization_is_refused_in_one_line(fp8_checkpoint, tmp_path, capsys, change, message):
    folder = str(tmp_path / "other")
    os.makedirs(folder)
    os.symlink(os.path.join(fp8_checkpoint[0], "model.safetensors"), os.path.join(folder, "model.safetensors"))
    config = json.load(open(os.path.join(fp8_checkpoint[0], "config.json")))
    config["quantization_config"].update(change)
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    err = _refusal(folder, tmp_path, capsys)
    assert message in err and "Fix: import a bf16 copy" in err, err


SCALE = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"  # [1, 2]: a transposed grid shows


@pytest.mark.parametrize("edit, message", [
    ("no_config", "has no quantization_config, but the checkpoint holds 'model.layers.0.mlp.down_proj.weight' "
                  "(F8_E4M3)"),
    ("no_scale", "FP8 weight 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' has no "
                 f"'{SCALE}'"),
    ("transposed_grid", f"'{SCALE}' has shape [2, 1] for a weight of shape [32, 160]; 128x128 blocks need [1, 2]"),
    ("bf16_scale", f"'{SCALE}' is BF16; from-hf reads float32 (F32) scales"),
])
def test_a_damaged_fp8_checkpoint_is_refused_in_one_line(fp8_checkpoint, tmp_path, capsys, edit, message):
    from safetensors.torch import save_file

    source, stored, _ = fp8_checkpoint
    tensors, config = dict(stored), json.load(open(os.path.join(source, "config.json")))
    if edit == "no_config":
        del config["quantization_config"]
    elif edit == "no_scale":
        del tensors[SCALE]
    elif edit == "transposed_grid":
        tensors[SCALE] = tensors[SCALE].t().contiguous()
    else:
        tensors[SCALE] = tensors[SCALE].to(torch.bfloat16)
    folder = str(tmp_path / edit)
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    err = _refusal(folder, tmp_path, capsys)
    assert message in err, err
