"""Hugging Face interop: from-hf / to-hf against tiny random models made by transformers.

Quadra's forward on converted weights equals transformers' logits (fp32, 1e-5); an export reloads
with ``AutoModelForCausalLM`` to the same logits; HF -> DCP -> HF is bitwise; llama3 RoPE scaling
equals transformers'; a converted checkpoint trains under FSDP 2 and TP 2 from its first step. For
Llama, Mixtral, Qwen3 and Qwen3-MoE.
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

from engine.checkpoint import files  # noqa: E402
from engine.checkpoint.files import CheckpointError  # noqa: E402
from engine.convert.hf import export_hf_model, import_hf_model  # noqa: E402
from engine.convert.hf_adapter import hf_config_from_args  # noqa: E402
from tests.training_utils import REPO, SMALL_CORPUS, base_args  # noqa: E402

VOCAB = 320  # the test tokenizer's size (256 bytes + 3 specials + merges)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
MODELS = {
    # Llama-2/3 shape: GQA, untied, default RoPE; stored in bf16 and in several shards.
    "llama": ("llama", dict(rope_theta=10000.0, tie_word_embeddings=False), torch.bfloat16),
    # Llama-3.2 shape: tied embeddings and llama3 RoPE scaling (scaled at this original context of 16).
    "llama_tied_scaled": ("llama", dict(rope_theta=500000.0, tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING),
                          torch.float32),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02), torch.float32),
    # Qwen3 (0.6B shape: tied, QK-norm, heads of 32 on a width of 64 with 4 heads) and Qwen3-MoE.
    "qwen3_tied": ("qwen3", dict(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True), torch.bfloat16),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True, router_aux_loss_coef=0.001), torch.float32),
    # YaRN on a Llama config (transformers reads it for every RoPE model; Quadra for llama and qwen3)
    "llama_yarn": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}), torch.float32),
    # Qwen3's long-context YaRN as its model cards publish it (factor 4 over the original context,
    # here 32 of 128 positions): every frequency band of the ramp and the attention factor.
    "qwen3_yarn": ("qwen3", dict(head_dim=32, rope_theta=1000000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), torch.float32),
}


def _hf_model(kind: str, extra: dict, seed: int):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        config = transformers.LlamaConfig(intermediate_size=160, **common, **extra)
        model_cls = transformers.LlamaForCausalLM
    elif kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, **common, **extra)
        model_cls = transformers.MixtralForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(intermediate_size=160, **common, **extra)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=160, **common, **extra)
        model_cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random norms too, so that swapped norm weights would show
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{name: (hf folder, DCP folder, HF model in fp32)}: each model saved by transformers, then from-hf."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, (name, (kind, extra, dtype)) in enumerate(MODELS.items()):
        model = _hf_model(kind, extra, seed)
        hf_dir, dcp_dir = str(root / name), str(root / f"{name}_dcp")
        with torch.no_grad():  # the fp32 reference holds the values the file stores
            for param in model.parameters():
                param.copy_(param.to(dtype))
        # A copy: .to() would also round the RoPE frequencies buffer of the reference model.
        copy.deepcopy(model).to(dtype).save_pretrained(hf_dir, max_shard_size="60KB")
        import_hf_model(hf_dir, dcp_dir)
        out[name] = (hf_dir, dcp_dir, model)
    return out


def quadra_model(checkpoint_dir: str):
    """Quadra's single-device model with the weights of a DCP checkpoint (its quadra.json's model)."""
    import torch.distributed.checkpoint as dcp

    from engine.checkpoint.state import quiet_single_process
    from engine.setup.model_builder import build_meta_model, materialize
    from models.resolve import args_from_record

    spec, args = args_from_record(files.read_marker(checkpoint_dir)["model"], checkpoint_dir)
    model = materialize(build_meta_model(spec, args), torch.device("cpu"), seed=0)
    state = model.state_dict()
    with quiet_single_process():
        dcp.load({"model": state}, checkpoint_id=checkpoint_dir, no_dist=True)
    model.load_state_dict(state)
    return model.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_llama3_rope_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.common.decoder import rope_frequencies

    for factor, original in ((8.0, 8192), (32.0, 8192), (8.0, 16)):  # Llama 3.1, 3.2, the tiny test model
        config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling={
            **LLAMA3_SCALING, "factor": factor, "original_max_position_embeddings": original})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        got = rope_frequencies(128, 500000.0, (factor, 1.0, 4.0, original))
        torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
        assert not torch.allclose(got, rope_frequencies(128, 500000.0))  # the scaling changes some


@pytest.mark.parametrize("name", list(MODELS))
def test_from_hf_forward_equals_transformers(converted, name):
    hf_dir, dcp_dir, hf_model = converted[name]
    record = files.read_marker(dcp_dir)["model"]
    assert record["name"] == {"mixtral": "moe", "llama": "llama"}.get(MODELS[name][0], MODELS[name][0])
    if MODELS[name][0].startswith("qwen3"):  # a head width apart from dim / n_heads, QK-norm
        assert record["args"]["head_size"] == 32 and record["args"]["qk_norm"]
    if name == "llama_tied_scaled":
        assert record["args"]["tie_embeddings"] and record["args"]["rope_scaling"] == "llama3"
    if name == "qwen3_yarn":
        assert (record["args"]["rope_scaling"], record["args"]["rope_scaling_factor"],
                record["args"]["rope_original_max_seq_len"]) == ("yarn", 4.0, 32)
    tokens = _tokens()
    with torch.no_grad():
        want = hf_model(tokens).logits
        got = quadra_model(dcp_dir)(tokens)
    assert _max_diff(got, want) < 1e-5, _max_diff(got, want)


@pytest.mark.parametrize("name", list(MODELS))
def test_to_hf_reloads_in_transformers_and_round_trips_bitwise(converted, tmp_path, name):
    from safetensors import safe_open

    hf_dir, dcp_dir, _ = converted[name]
    dtype = "bfloat16" if MODELS[name][2] == torch.bfloat16 else None
    out = str(tmp_path / "export")
    info = export_hf_model(dcp_dir, out, dtype=dtype, max_shard_bytes=60_000)
    assert info["shards"] > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))

    def tensors(folder):
        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
        result = {}
        for key, file_name in index.items():
            with safe_open(os.path.join(folder, file_name), "pt") as f:
                result[key] = f.get_tensor(key)
        return result

    original, exported = tensors(hf_dir), tensors(out)
    assert original.keys() == exported.keys()
    unequal = [k for k in original if original[k].dtype != exported[k].dtype or not torch.equal(original[k], exported[k])]
    assert not unequal, unequal[:3]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tokens = _tokens(1)
    with torch.no_grad():
        assert _max_diff(reloaded(tokens).logits, quadra_model(dcp_dir)(tokens)) < 1e-5


def test_preflight_refuses_another_model_than_the_checkpoint(converted, tmp_path):
    from engine.config import load_config
    from engine.setup.preflight import check_setup

    _, dcp_dir, _ = converted["llama_tied_scaled"]
    overrides = {"checkpoint.enable": "true", "checkpoint.initial_load_path": dcp_dir, "model.flavor": "debugmodel",
                 "model.tokenizer_path": os.path.join(REPO, "assets", "tokenizer", "shakespeare.model")}
    cfg = load_config(base_args(str(tmp_path / "run"), overrides))
    with pytest.raises(ValueError, match=r"holds another model than llama/debugmodel \(dim=64 vs 256\).*"
                                         r"--model.args_path"):
        check_setup(cfg, 1, "cpu", check_data=False)
    cfg = load_config(base_args(str(tmp_path / "run"), {**overrides, "model.args_path": dcp_dir}))
    with pytest.raises(ValueError, match="has 4096 tokens but model llama from .* has vocab_size 320"):
        check_setup(cfg, 1, "cpu", check_data=False)  # the bundled tokenizer is larger than the model
    cfg = load_config(base_args(str(tmp_path / "run"), {**overrides, "model.args_path": dcp_dir,
                                                        "model.vocab_size": "4096"}))
    with pytest.raises(ValueError, match=r"\(vocab_size=320 vs 4096\)"):
        check_setup(cfg, 1, "cpu", check_data=False)
    mixtral = converted["mixtral"][1]
    cfg = load_config(base_args(str(tmp_path / "run"), {**overrides, "model.args_path": mixtral}))
    with pytest.raises(ValueError, match="describes a 'moe' model but model.name = 'llama'"):
        check_setup(cfg, 1, "cpu", check_data=False)


def test_models_without_a_hugging_face_equivalent_are_refused():
    from engine.convert.hf_adapter import weight_rules
    from models.registry import get_model_args

    deepseek_style = get_model_args("moe", "debugmodel")  # shared expert, dense first layer, routing bias
    with pytest.raises(CheckpointError, match="no shared experts, no dense layers"):
        weight_rules("moe", deepseek_style)
    with pytest.raises(CheckpointError, match="score_func = 'sigmoid'"):
        hf_config_from_args("moe", deepseek_style, dtype="float32", bos_id=1, eos_id=2)
    config = hf_config_from_args("moe", get_model_args("moe", "debugmodel_mixtral"), dtype="float32",
                                 bos_id=1, eos_id=2)
    assert config["model_type"] == "mixtral" and config["router_aux_loss_coef"] == 0.01


def test_command_line(converted, tmp_path, capsys):
    """from-hf / to-hf through scripts/convert_checkpoint.py: the printed next step, and one-line refusals."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(REPO, "scripts",
                                                                                    "convert_checkpoint.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf_dir = converted["mixtral"][0]
    seed = str(tmp_path / "seed")
    assert script.main(["from-hf", hf_dir, seed]) == 0
    out = capsys.readouterr().out
    assert (f"--checkpoint.initial_load_path {seed} --model.args_path {seed} "
            f"--job.dump_folder {os.path.join(os.path.dirname(seed), 'run')} --model.name moe") in out
    assert script.main(["from-hf", hf_dir, seed]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    assert script.main(["to-hf", seed, str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert "1 safetensors file(s)" in capsys.readouterr().out
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # like config.json
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["torch_dtype"] == "bfloat16" and config["num_local_experts"] == 4
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert script.main(["from-hf", str(gpt2), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type = 'gpt2' is not supported" in err
    assert script.main(["to-hf", seed, str(tmp_path / "y"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size 'lots' is not a size" in capsys.readouterr().err
    assert script.main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "z")]) == 2  # before torch loads
    assert capsys.readouterr().err == f"error: checkpoint_dir {tmp_path / 'missing'}: no such file or folder\n"
    from engine.convert.tools import DTYPES

    assert script.DTYPE_NAMES == tuple(sorted(DTYPES))  # the torch-free copy of the --dtype choices


# ---------------------------------------------------------------- continued pretraining
def _train_from_converted(folder: str, dcp_dir: str, tokenizer: str) -> dict:
    from tests.training_utils import train_layouts

    common = {"model.name": files.read_marker(dcp_dir)["model"]["name"], "checkpoint.enable": "true", "checkpoint.initial_load_path": dcp_dir, "model.args_path": dcp_dir,
              "model.tokenizer_path": tokenizer, "training.steps": "3", "checkpoint.interval": "3"}
    return train_layouts(folder, {"fsdp": {**common, "parallelism.dp_shard": "2", "training.local_batch_size": "4"},
                                  "tp": {**common, "parallelism.dp_shard": "1", "parallelism.tp": "2"}})


@pytest.mark.parametrize("name", ["llama_tied_scaled", "mixtral", "qwen3_tied", "qwen3_moe"])
def test_converted_checkpoint_trains_under_fsdp_and_tp_and_exports(converted, hf_tokenizer, tmp_path, name):
    """Step 1 of both layouts has the loss transformers computes on the same batch (so training starts
    from the converted weights); both layouts agree over 3 steps; the trained checkpoint exports to
    transformers with Quadra's logits."""
    import torch.nn.functional as F

    from engine.config import load_config
    from engine.data.builders import build_dataloader
    from engine.data.tokenizer import Tokenizer
    from engine.testing.processes import run_distributed

    _, dcp_dir, hf_model = converted[name]
    results = run_distributed(_train_from_converted, 2, str(tmp_path), dcp_dir, hf_tokenizer, timeout=300)
    cfg = load_config(base_args(str(tmp_path / "x"), {"model.tokenizer_path": hf_tokenizer}))
    t = cfg.training
    inputs, labels = build_dataloader(cfg.data, Tokenizer(hf_tokenizer), seq_len=t.seq_len,
                                      local_batch_size=t.local_batch_size, global_batch_size=t.global_batch_size,
                                      dp_rank=0, dp_degree=1, seed=t.seed).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(hf_model(inputs).logits.flatten(0, 1), labels.flatten()).item()
    histories = {name: results[0][name] for name in ("fsdp", "tp")}
    for name, history in histories.items():
        assert not isinstance(history, str), history
        assert len(history) == 3 and math.isclose(history[0][0], want, rel_tol=1e-5), (name, history, want)
    for (loss, norm), (ref_loss, ref_norm) in zip(histories["tp"], histories["fsdp"]):
        assert math.isclose(loss, ref_loss, rel_tol=1e-4) and math.isclose(norm, ref_norm, rel_tol=1e-4)
    step3 = str(tmp_path / "fsdp" / "checkpoint" / "step-3")
    assert files.read_marker(step3)["model"] == files.read_marker(dcp_dir)["model"]
    export_hf_model(step3, str(tmp_path / "hf_out"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out"), dtype=torch.float32)
    assert os.path.isfile(tmp_path / "hf_out" / "tokenizer.json")
    tokens = _tokens(2)
    with torch.no_grad():
        trained = quadra_model(step3)(tokens)
        assert _max_diff(reloaded.eval()(tokens).logits, trained) < 1e-5
        assert _max_diff(trained, hf_model(tokens).logits) > 1e-3  # the weights did train


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer.json of VOCAB tokens made by scripts/train_tokenizer.py --format hf."""
    from scripts.train_tokenizer import main as train_tokenizer_main

    out = str(tmp_path_factory.mktemp("tokenizer"))
    return train_tokenizer_main(["--data_path", SMALL_CORPUS, "--vocab_size", str(VOCAB), "--output", out,
                                 "--format", "hf"])


def test_to_hf_of_an_older_checkpoint_reads_the_config_it_was_saved_with(tmp_path):
    """A checkpoint whose quadra.json predates the model record: to-hf builds the model from the
    [model] section of the config stored with it (here the debug flavor, tied, with the bundled
    SentencePiece tokenizer's ids)."""
    from engine.convert.tools import save_seed_checkpoint
    from engine.config import load_config

    cfg = load_config(base_args(str(tmp_path / "run"), {"checkpoint.enable": "true", "model.tie_embeddings": "true",
                                                              "model.flavor": "debugmodel"}))
    seed = save_seed_checkpoint(cfg)
    marker = files.read_marker(seed)
    del marker["model"]
    files.write_marker(seed, marker)
    export_hf_model(seed, str(tmp_path / "out"))
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (256, 6, 4096)
    assert config["tie_word_embeddings"] and (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["intermediate_size"] == 768 and config["max_position_embeddings"] == 2048
