"""DeepSeek-V3's multi-token prediction (models/deepseek_v3/mtp.py) against a plain re-computation.

transformers' ``DeepseekV3ForCausalLM`` has no MTP module (it ignores the checkpoints' layer 61), so
the reference here is written from arXiv 2412.19437 §2.2 independently of the model's code: depth k
runs on the first S - k positions only (slices, where the model rolls and masks), its input
[enorm(Emb(tokens[k:])); hnorm(h^{k-1}[:S-k])] through eh_proj and the block, its targets
labels[k:] (token t+1+k), the objective main + weight · mean over depths, in float64.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_v3.flavors import deepseek_v3_flavors
from models.deepseek_v3.model import DeepseekV3Transformer

WEIGHT = 0.3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV3Transformer(deepseek_v3_flavors["debugmodel_mtp"])
    m.init_weights(seed=3)
    m.double()
    m.mtp_weight = WEIGHT
    return m


def _reference(m, tokens, labels, documents=None):
    """(main token sum, [depth k's token sum], [depth k's target count]) by slicing, float64."""
    seq = tokens.shape[1]
    extra = {} if documents is None else {"documents": documents}
    h = m.tok_embeddings(tokens)
    for layer in m.layers.values():
        h = layer(h, m.rope_cos, m.rope_sin, **extra)
    main = F.cross_entropy(m.output(m.norm(h)).flatten(0, 1), labels.flatten(), reduction="sum")
    sums, counts = [], []
    for k, module in enumerate(m.mtp.values(), start=1):
        n = seq - k
        x = module.eh_proj(torch.cat([module.enorm(m.tok_embeddings(tokens[:, k:])), module.hnorm(h[:, :n])], -1))
        kw = {} if documents is None else {"documents": documents[:, :n]}
        h = module.block(x, m.rope_cos, m.rope_sin, **kw)
        target = labels[:, k:].clone()
        if documents is not None:  # token t+k must be in token t's document
            target[documents[:, k:] != documents[:, :n]] = -100
        sums.append(F.cross_entropy(m.output(module.norm(h)).flatten(0, 1), target.flatten(), reduction="sum",
                                    ignore_index=-100))
        counts.append(int((target != -100).sum()))
    return main, sums, counts


def _batch(vocab: int, documents: bool):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 24), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.randint(0, vocab, (2, 1), generator=g)], dim=1)
    ids = None
    if documents:  # documents start at positions 0, 7 and 15 (row 0) and 0, 11 (row 1)
        ids = torch.zeros(2, 24, dtype=torch.int32)
        ids[0, 7:], ids[0, 15:], ids[1, 11:] = 1, 2, 1
    return tokens, labels, ids


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["unfused", "fused"])
def test_mtp_objective_equals_plain_recomputation(model, chunk_tokens, documents):
    tokens, labels, ids = _batch(model.model_args.vocab_size, documents)
    main, sums, counts = _reference(model, tokens, labels, ids)
    model.mtp_stats.zero_()
    got = model(tokens, labels=labels, documents=ids, loss_chunk_tokens=chunk_tokens)
    want = main + WEIGHT * sum(sums) / len(sums)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got.item(), want.item())
    assert model.mtp_stats[1].tolist() == counts  # targets per depth: S - k, less those across documents
    assert torch.allclose(model.mtp_stats[0], torch.stack(sums), rtol=1e-12, atol=0)
    model.eval()
    try:  # evaluation: the main loss only
        assert torch.allclose(model(tokens, labels=labels, documents=ids, loss_chunk_tokens=chunk_tokens), main,
                              rtol=1e-12, atol=0)
    finally:
        model.train()
    # logged: each depth's mean over its targets, averaged over depths (it also moves the routing biases)
    logged = model.post_optimizer_step()["mtp_loss"][0]
    assert torch.allclose(logged, sum(s / c for s, c in zip(sums, counts)) / len(sums), rtol=1e-12)


@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["unfused", "fused"])
def test_z_loss_is_added_to_the_main_head_with_mtp(model, chunk_tokens):
    """PaLM's z-loss (Chowdhery et al. 2022, Sec. 5) on the MTP path: the objective gains
    weight x Σ logsumexp(main logits)^2 over the label tokens, computed here from the logits, and the
    run's ZLoss logs that sum (it was dropped: z_loss 0 and the same loss as without it)."""
    from engine.train.loss import ZLoss

    tokens, labels, _ = _batch(model.model_args.vocab_size, False)
    main, sums, _ = _reference(model, tokens, labels)
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, model.rope_cos, model.rope_sin)
    z_want = 1e-2 * torch.logsumexp(model.output(model.norm(h)), dim=-1).square().sum()
    model.z_loss = ZLoss(1e-2)
    try:
        got = model(tokens, labels=labels, loss_chunk_tokens=chunk_tokens)
        logged = model.z_loss.take()
    finally:
        del model.z_loss
        model.mtp_stats.zero_()
    assert torch.allclose(torch.as_tensor(logged, dtype=torch.float64), z_want, rtol=1e-12, atol=0), (logged, z_want)
    want = main + z_want + WEIGHT * sum(sums) / len(sums)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got.item(), want.item())


def test_routing_metrics_average_over_every_routed_block_the_mtp_depths_included(model):
    """``moe_balance_loss`` (1.0 when balanced) and the tokens-per-expert cv are means over every MoE
    block that routed tokens: the MTP depths' blocks route too (their sum over the main blocks' count
    logged 2.0 for a balanced model)."""
    tokens, labels, _ = _batch(model.model_args.vocab_size, False)
    model.set_aux_loss_scale(tokens.shape[0])  # a mean over the step's sequences, as the trainer sets it
    for layer in model.moe_layers():
        layer.reset_stats()
    model(tokens, labels=labels)
    layers = model.moe_layers()
    assert len(layers) == model.model_args.n_routed_blocks > model.model_args.n_moe_layers
    want = sum(float(layer.balance_loss_sum) for layer in layers) / len(layers)
    got = float(model.post_optimizer_step()["moe_balance_loss"][0])
    assert math.isclose(got, want, rel_tol=1e-12) and 0.5 < got < 2.0, (got, want)


def test_mtp_gradient_reaches_the_shared_embedding_through_every_depth(model):
    """The MTP terms reach the shared embedding (its gradient differs from the main loss's alone) and
    the modules' own weights."""
    tokens, labels, _ = _batch(model.model_args.vocab_size, False)
    model.zero_grad()
    model.mtp_weight = 0.0
    model(tokens, labels=labels, loss_chunk_tokens=0).backward()
    main_only = model.tok_embeddings.weight.grad.clone()
    model.zero_grad()
    model.mtp_weight = WEIGHT
    model(tokens, labels=labels, loss_chunk_tokens=0).backward()
    assert not torch.allclose(model.tok_embeddings.weight.grad, main_only)
    assert model.mtp["1"].eh_proj.weight.grad.abs().sum() > 0
    model.zero_grad()
    model.mtp_stats.zero_()


def test_pipeline_split_puts_mtp_and_an_embedding_copy_on_the_last_stage():
    """parallelisms/pipeline.py: the MTP modules go with the output head; the last stage keeps a copy
    of the embedding under its own name (one checkpoint tensor) that does not embed its input, and
    only the first and last stages share it (their gradients are summed, parallelisms/pipeline_tied.py)."""
    from parallelisms.pipeline import build_stage_module

    with torch.device("meta"):
        model = DeepseekV3Transformer(deepseek_v3_flavors["debugmodel_mtp"])
    first, middle, last = (build_stage_module(model, (i,), i == 0, i == 2) for i in range(3))
    assert first.mtp is None and middle.mtp is None and middle.tok_embeddings is None
    assert set(last.mtp) == {"0", "1"} and last.tok_embeddings is not None
    assert (first.embeds_tokens, last.embeds_tokens) == (True, False)
    assert (first.shares_embeddings, middle.shares_embeddings, last.shares_embeddings) == (True, False, True)
    assert "tok_embeddings.weight" in dict(last.named_parameters())
    whole = build_stage_module(model, (0, 1, 2), True, True)  # one stage: no copy to keep equal
    assert whole.embeds_tokens and not whole.shares_embeddings


def test_a_rank_holding_both_ends_sums_their_gradients_and_counts_the_copy_once():
    """A V-shaped schedule puts the first and the last stage on one rank: parallelisms/pipeline_tied.py
    adds the two gradients there (no collective) and names only the copy as uncounted in the norm."""
    from parallelisms.pipeline_tied import sum_tied_gradients, tied_copies

    parts = []
    for embeds in (True, False):
        part = torch.nn.Module()
        part.tok_embeddings, part.embeds_tokens, part.shares_embeddings = torch.nn.Embedding(4, 2), embeds, True
        part.tok_embeddings.weight.grad = torch.full((4, 2), 1.0 if embeds else 2.0)
        parts.append(part)
    sum_tied_gradients(parts, plan=None, pp_group=None)
    for part in parts:
        assert torch.equal(part.tok_embeddings.weight.grad, torch.full((4, 2), 3.0))
    assert tied_copies(parts) == [parts[1].tok_embeddings.weight]


def test_hf_checkpoint_mtp_layer_imports_and_exports_bitwise(tmp_path, capsys):
    """A published checkpoint's MTP layer (``model.layers.{num_hidden_layers}.*``: enorm, hnorm,
    eh_proj, shared_head.norm, the block's names, and its copies of the embedding and head) reaches
    ``mtp.0`` through scripts/convert_checkpoint.py from-hf, and to-hf gives every tensor back bitwise
    (transformers' model has no MTP: its layers are written here by the checkpoint's names)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (a dev dependency)")
    from safetensors.torch import load_file, save_file

    from tests.unit.test_deepseek_v3 import MODELS, VOCAB, _hf_model
    from tests.integration.test_hf_interop import quadra_model
    from tests.unit.test_qwen3_convert import _script, _stored

    model = _hf_model(MODELS["qlora_yarn"], seed=5)
    hf_dir, dcp_dir, back_dir = str(tmp_path / "hf"), str(tmp_path / "dcp"), str(tmp_path / "back")
    model.save_pretrained(hf_dir)
    main = load_file(f"{hf_dir}/model.safetensors")
    last = model.config.num_hidden_layers  # the MTP layer's number; copy the last MoE block's names
    g = torch.Generator().manual_seed(7)
    mtp = {k.replace(f"layers.{last - 1}.", f"layers.{last}."): torch.randn(v.shape, generator=g)
           for k, v in main.items() if k.startswith(f"model.layers.{last - 1}.")}
    dim = model.config.hidden_size
    mtp.update({f"model.layers.{last}.{name}": torch.randn(shape, generator=g) for name, shape in (
        ("enorm.weight", (dim,)), ("hnorm.weight", (dim,)), ("eh_proj.weight", (dim, 2 * dim)),
        ("shared_head.norm.weight", (dim,)))})
    mtp[f"model.layers.{last}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{last}.shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file(mtp, f"{hf_dir}/mtp.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{hf_dir}/config.json"))
    json.dump({**config, "num_nextn_predict_layers": 1}, open(f"{hf_dir}/config.json", "w"))

    script = _script()
    assert script.main(["from-hf", hf_dir, dcp_dir]) == 0
    capsys.readouterr()
    quadra = quadra_model(dcp_dir)
    assert torch.equal(quadra.mtp["0"].eh_proj.weight, mtp[f"model.layers.{last}.eh_proj.weight"])
    assert torch.equal(quadra.mtp["0"].norm.weight, mtp[f"model.layers.{last}.shared_head.norm.weight"])
    assert torch.equal(quadra.mtp["0"].enorm.weight, mtp[f"model.layers.{last}.enorm.weight"])
    assert torch.equal(quadra.mtp["0"].block.attention.wkv_a.weight,
                       mtp[f"model.layers.{last}.self_attn.kv_a_proj_with_mqa.weight"])
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the main model is untouched by the MTP layer
        assert (quadra(tokens) - model(tokens).logits).abs().max().item() < 1e-5
    assert script.main(["to-hf", dcp_dir, back_dir]) == 0
    original, back = _stored(hf_dir), _stored(back_dir)
    assert back.keys() == original.keys()
    unequal = [k for k in original if not torch.equal(back[k], original[k])]
    assert not unequal, unequal[:3]
    assert json.load(open(f"{back_dir}/config.json"))["num_nextn_predict_layers"] == 1
    del transformers


def test_trainer_logs_mtp_loss_beside_the_objective(tmp_path):
    """One training step of the MTP flavor: ``mtp_loss`` (each depth's mean token cross entropy,
    averaged over depths) reaches the step's logged metrics, near ln(vocab) at initialization, and
    the objective is the main loss plus weight times the depths' token sums over the step's tokens."""
    import math

    from engine.config import load_config
    from engine.train.trainer import Trainer
    from tests.training_utils import base_args

    records = {}
    for weight in ("0.0", "0.3"):
        cfg = load_config(base_args(str(tmp_path / weight), {"model.name": "deepseek_v3",
                                                             "model.flavor": "debugmodel_mtp",
                                                             "loss.mtp_weight": weight, "training.steps": 1}))
        cfg.validate()
        trainer = Trainer(cfg)
        try:
            records[weight] = trainer.train_step()
        finally:
            trainer.close()
    plain, with_mtp = records["0.0"], records["0.3"]
    logged = with_mtp["model_metrics"]["mtp_loss"]
    assert abs(logged - math.log(4096)) < 1.0, logged
    assert plain["model_metrics"]["mtp_loss"] == pytest.approx(logged, rel=1e-6)  # computed, not weighed in
    # the depths have S - 1 and S - 2 targets per sequence of S: their token sums over the step's
    # label tokens are that share of the mean
    seq = 32
    share = sum((seq - k) / seq for k in (1, 2)) / 2
    assert with_mtp["loss"] - plain["loss"] == pytest.approx(0.3 * logged * share, rel=1e-3)
