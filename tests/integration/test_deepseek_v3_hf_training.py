"""A DeepSeek-V3 made by transformers, converted with from-hf, trained under ep 2, tp 2 and ep 2 × fsdp 2,
exported with to-hf and reloaded by transformers (as tests/integration/test_hf_interop.py does for Llama, Mixtral
and Qwen3).

The model has DeepSeek-V3's published routing and attention hyperparameters at a small width
(deepseek-ai/DeepSeek-V3's config.json): 8 groups of which a token may use 4, top-8 routing,
groups of 4 experts (more than the 2 best that score a group), routed_scaling_factor 2.5,
norm_topk_prob, one shared expert, a dense first layer, the query latent 3 times the key-value
latent's width, rotated query-key channels half the non-rotated ones, YaRN factor 40 over 4096
positions with mscale = mscale_all_dim = 1, and a non-zero e_score_correction_bias that training
moves (load_balance_coeff 1e-3, DeepSeek-V3's bias update speed, written into the converted record
as models/deepseek_v3/hf.py asks).

Oracle: transformers' own model trained in a plain PyTorch loop on the same batches (torch's clip and
AdamW, the bias step by hand; :func:`_transformers_loop`). Every layout has its loss and grad norm
(rel 1e-5 at step 1, so training starts from the converted weights; 1e-4 at steps 2-3, fp32,
steps 1-2 clipped and step 3 not), so does every other layout, and every layout's step-3 checkpoint
has its logits (an expert or head that one layout saves in the wrong place shows there). The ep 2 ×
fsdp 2 checkpoint exports with to-hf and reloads in ``AutoModelForCausalLM`` with Quadra's logits
(1e-5) and the loop's routing bias, bitwise. The ranks cannot host layouts of 2 ranks in a launch of
4 (a Trainer's mesh spans the world), so the 2-rank layouts share one launch and ep 2 × fsdp 2 has its own.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")

from engine.checkpoint import files  # noqa: E402
from engine.convert.hf import export_hf_model, import_hf_model  # noqa: E402
from engine.parity import compare  # noqa: E402
from tests.integration.test_hf_interop import hf_tokenizer, quadra_model  # noqa: E402,F401  (hf_tokenizer: a fixture)
from tests.training_utils import base_args, clipping_sides, train_layouts  # noqa: E402


VOCAB = 320  # the test tokenizer's size (tests/integration/test_hf_interop.py)
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=160, moe_intermediate_size=16, n_routed_experts=32, num_experts_per_tok=8,
              n_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4, norm_topk_prob=True,
              routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=YARN, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
BIAS_UPDATE_SPEED = 1e-3  # DeepSeek-V3's γ (arXiv 2412.19437 §4.2)
# The grad norms are 2.02, 1.92 and 1.29 (steps 1-3): steps 1-2 are clipped, step 3 is not (by
# CLIP_MARGIN). Without the clip, step 2's loss moves by 3.5e-4 (relative), over the 1e-4 tolerance.
MAX_NORM = 1.6
# {name: (world_size, overrides)}; every layout trains the global batch of 8 sequences of 32 tokens.
LAYOUTS = {
    "ep2": (2, {"parallelism.dp_shard": "2", "parallelism.ep": "2", "training.local_batch_size": "4"}),
    "tp2": (2, {"parallelism.dp_shard": "1", "parallelism.tp": "2"}),
    "ep2_x_fsdp2": (4, {"parallelism.dp_shard": "4", "parallelism.ep": "2", "training.local_batch_size": "2"}),
}
EXPORTED = "ep2_x_fsdp2"


def _hf_model():
    """transformers' DeepseekV3ForCausalLM of :data:`CONFIG` in fp32, eval mode, random weights."""
    from tests.unit.test_deepseek_v3 import random_hf_model

    return random_hf_model(transformers.DeepseekV3Config(**CONFIG), 0)


def _common(dcp_dir: str, tokenizer: str) -> dict:
    """Overrides of every layout: continue from the converted checkpoint (its record is the model),
    3 steps, the checkpoint of step 3 saved."""
    return {"model.name": "deepseek_v3", "model.flavor": "debugmodel", "model.args_path": dcp_dir,
            "checkpoint.enable": "true", "checkpoint.initial_load_path": dcp_dir, "checkpoint.interval": "3",
            "model.tokenizer_path": tokenizer, "training.steps": "3", "training.max_norm": str(MAX_NORM)}


def _train(folder: str, world_size: int, common: dict) -> dict:
    """In every forked rank: the layouts of ``world_size`` in turn, {name: History or traceback}."""
    return train_layouts(folder, {name: {**common, **overrides} for name, (size, overrides) in LAYOUTS.items()
                                  if size == world_size})


def _batches(tokenizer: str, folder: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, labels) [8, 32] of the first ``steps`` global batches a run of ``base_args`` trains."""
    from engine.config import load_config
    from engine.data.builders import build_dataloader
    from engine.data.tokenizer import Tokenizer

    cfg = load_config(base_args(folder, {"model.tokenizer_path": tokenizer}))
    t = cfg.training
    loader = build_dataloader(cfg.data, Tokenizer(tokenizer), seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                              global_batch_size=t.global_batch_size, dp_rank=0, dp_degree=1, seed=t.seed)
    return [loader.next_batch() for _ in range(steps)]


def _transformers_loop(model, batches, folder: str) -> list[tuple[float, float]]:
    """Train transformers' ``model`` in place as the run's settings say, written from the papers, not
    from the engine: mean token cross entropy, the global norm (fp64) clipped to MAX_NORM by torch,
    ``torch.optim.AdamW`` with decay on matrices only (GPT-3 App. B), lr warmed up linearly over 2
    steps then decayed linearly to 0 at the last step (engine/train/lr_scheduler.py's docstring),
    and after every step each MoE layer's e_score_correction_bias += γ · sign(mean load - load),
    the load being the step's routed slots per expert (DeepSeek-V3 §2.1.2, Wang et al. 2024 eq. 3).

    Returns:
        [(loss, grad norm before clipping)] per step.
    """
    import torch.nn.functional as F

    from engine.config import load_config

    opt = load_config(base_args(folder)).optimizer
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, foreach=False)
    loads = {}
    gates = [module.gate for module in model.modules() if hasattr(module, "shared_experts")]
    for gate in gates:  # the router returns (logits, weights, expert ids [tokens, top_k])
        gate.register_forward_hook(lambda gate, _, out: loads.__setitem__(
            gate, torch.bincount(out[2].flatten(), minlength=gate.num_experts).double()))
    history = []
    model.train()
    for step, (inputs, labels) in enumerate(batches, start=1):
        loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad.double() for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        for group in optimizer.param_groups:
            group["lr"] = opt.lr * (step / 2 if step <= 2 else 1 - (step - 2) / (len(batches) - 2))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for gate in gates:
                load = loads[gate]
                gate.e_score_correction_bias += BIAS_UPDATE_SPEED * torch.sign(load.mean() - load).float()
        history.append((loss.item(), norm.item()))
    return history


def test_converted_deepseek_v3_trains_under_ep_tp_and_ep_x_fsdp_and_exports(hf_tokenizer, tmp_path):  # noqa: F811
    """Every layout trains as transformers' model does in a plain loop (step 1: the same loss, so
    training starts from the converted weights; steps 2-3 after clipped updates and bias steps); the
    layouts agree step by step; each layout's step-3 checkpoint has the loop's logits, and ep 2 ×
    fsdp 2's exports with to-hf and reloads in transformers with Quadra's logits and trained bias."""
    from engine.testing.processes import run_distributed
    from tests.unit.test_qwen3_convert import _stored

    hf_model, hf_dir, dcp_dir = _hf_model(), str(tmp_path / "hf"), str(tmp_path / "dcp")
    copy.deepcopy(hf_model).save_pretrained(hf_dir)
    import_hf_model(hf_dir, dcp_dir)
    marker = files.read_marker(dcp_dir)
    marker["model"]["args"]["load_balance_coeff"] = BIAS_UPDATE_SPEED
    files.write_marker(dcp_dir, marker)

    histories = {}
    for world_size in (2, 4):  # a Trainer's mesh spans every rank: one launch per world size
        results = run_distributed(_train, world_size, str(tmp_path), world_size, _common(dcp_dir, hf_tokenizer),
                                  timeout=300)
        histories.update(results[0])
    looped = copy.deepcopy(hf_model)
    want = _transformers_loop(looped, _batches(hf_tokenizer, str(tmp_path / "x"), 3), str(tmp_path / "x"))
    assert clipping_sides(want, MAX_NORM) == (2, 1), want
    for name, history in histories.items():
        assert not isinstance(history, str), history
        assert len(history) == 3, (name, history)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, want), start=1):
            tol = compare.tolerance(step)  # fp32: 1e-5 at step 1, 1e-4 later (engine/parity/compare.py)
            assert math.isclose(loss, ref_loss, rel_tol=tol), (name, step, loss, ref_loss)
            assert math.isclose(norm, ref_norm, rel_tol=tol), (name, step, norm, ref_norm)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, histories["ep2"]), start=1):
            assert math.isclose(loss, ref_loss, rel_tol=1e-4), (name, step, loss, ref_loss)
            assert math.isclose(norm, ref_norm, rel_tol=1e-4), (name, step, norm, ref_norm)

    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = looped.eval()(tokens).logits
        assert (expected - hf_model(tokens).logits).abs().max().item() > 0.1  # the weights did train
        for name in LAYOUTS:
            trained = quadra_model(str(tmp_path / name / "checkpoint" / "step-3"))
            # 6e-6 to 8e-6 measured; an expert or head saved in another place moves logits by O(1)
            diff = (trained(tokens) - expected).abs().max().item()
            assert diff < 1e-3, (name, diff)

    step3, out = str(tmp_path / EXPORTED / "checkpoint" / "step-3"), str(tmp_path / "hf_out")
    assert files.read_marker(step3)["model"] == marker["model"]
    export_hf_model(step3, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = quadra_model(step3)
    with torch.no_grad():
        diff = (reloaded(tokens).logits - trained(tokens)).abs().max().item()
        assert diff < 1e-5, diff
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    exported, original = _stored(out)[bias], _stored(hf_dir)[bias]
    assert torch.equal(exported, trained.layers["1"].feed_forward.router.expert_bias)
    assert torch.equal(exported, looped.model.layers[1].mlp.gate.e_score_correction_bias)
    assert (exported - original).abs().max().item() > BIAS_UPDATE_SPEED / 2  # the bias trained too
