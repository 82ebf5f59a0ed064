"""Imported recipes at their published hyperparameters (small widths, the real group sizes, ratios,
lengths and depths) against a reference of their own: a debug shape can make two rules agree (groups
of 2 whose best 2 are the whole group, a YaRN ramp whose rounded bound clamps to 0 anyway, one
failure in a launch). References: transformers' DeepSeek-V3 router and attention, the YaRN and
DeepSeek-V3 papers' formulas, a hand count of the goodput ledger. The training-run cases (a new phase
from a checkpoint, validation with the z-loss) are in tests/integration/test_published_runs.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch


def _transformers():
    """transformers (a dev dependency) and tests/unit/test_deepseek_v3.py's small config; skips without it."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (a dev dependency: pip install -e '.[dev]')")
    from tests.unit.test_deepseek_v3 import SMALL

    return transformers, SMALL

# deepseek-ai/DeepSeek-V3's config.json routing at a 16-wide hidden state: 256 routed experts in 8 groups of 32
# (a group scores its 2 best of 32, not its whole self as in the debug shape's groups of 2), 4 groups per
# token, top-8, sigmoid, routed_scaling_factor 2.5, norm_topk_prob; a correction bias of both signs.
PUBLISHED_ROUTING = dict(hidden_size=16, n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                         routed_scaling_factor=2.5, norm_topk_prob=True)


def test_published_routing_selects_and_weighs_as_transformers():
    """``GroupLimitedRouter`` against transformers' ``DeepseekV3TopkRouter`` on the same gate and bias,
    512 tokens: the same 8 experts per token and the same weights. transformers' router casts to
    float32 whatever the model's dtype, so both run float32 on the same gate matmul (the selections are
    then equal on any CPU; the weights differ only by the order of the renormalizing sum)."""
    transformers, SMALL = _transformers()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from models.deepseek_v3.hf import args_from_config
    from models.deepseek_v3.model import GroupLimitedRouter

    config = transformers.DeepseekV3Config(**{**SMALL, **PUBLISHED_ROUTING}, q_lora_rank=None)
    args = args_from_config(config.to_dict())
    assert (args.num_experts, args.n_group, args.topk_group, args.top_k, args.route_scale) == (256, 8, 4, 8, 2.5)
    g = torch.Generator().manual_seed(0)
    theirs, ours = DeepseekV3TopkRouter(config), GroupLimitedRouter(args)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(256, 16, generator=g))
        theirs.e_score_correction_bias.copy_(0.05 * torch.randn(256, generator=g))
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(512, 16, generator=g)
        _, want_weights, want_ids = theirs(x)
        got_weights, got_ids, scores = ours(x)
    want_ids, order = want_ids.sort(dim=-1)  # transformers' top-k is unsorted: compare by expert id
    got_ids, got_order = got_ids.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_weights.gather(1, got_order), want_weights.gather(1, order), rtol=1e-6, atol=0)
    assert torch.allclose(got_weights.sum(-1), torch.full((512,), 2.5), rtol=1e-6)
    # The published shape is one where each rule bites: without the group limit, or without the bias,
    # most tokens would pick other experts; a token's experts lie in at most 4 of the 8 groups.
    unlimited = (scores + ours.expert_bias).topk(8).indices.sort(-1).values
    unbiased = scores.topk(8).indices.sort(-1).values
    assert (unlimited != got_ids).any(-1).float().mean() > 0.5
    assert (unbiased != got_ids).any(-1).float().mean() > 0.5
    assert max(len(set((row // 32).tolist())) for row in got_ids) <= 4
    assert (ours.expert_bias < 0).any() and (ours.expert_bias > 0).any()


# deepseek-ai/DeepSeek-V3's YaRN and head widths: rope_theta 1e4, factor 40 from 4096 positions, beta 32 / 1,
# mscale = mscale_all_dim = 1 (so the cos/sin factor is 1 and only the softmax scale moves), qk_nope 128,
# qk_rope 64, v 128; hidden 48, 4 heads and a latent of 16 (small widths).
PUBLISHED_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
PUBLISHED_HEADS = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=16,
                       max_position_embeddings=163840)


def test_published_yarn_frequencies_and_softmax_scale_equal_transformers_and_the_formula():
    """At the published values YaRN's ramp runs over channel pairs floor(10.47) = 10 to ceil(22.51) = 23
    of 32 (the debug shape's 4 pairs clamp the low bound to 0 whatever the rounding), the cos/sin
    factor is 1 and the softmax scale 192^-1/2 · (0.1 ln 40 + 1)^2 (arXiv 2309.00071 §3.2 and eq. 22,
    DeepSeek's mscale_all_dim): frequencies against transformers' "yarn" init (float32 there) and the
    hand ramp, the scale against ``DeepseekV3Attention.scaling`` and the hand formula, and one MLA
    forward (float64, 12 positions) against transformers' attention on the same weights."""
    transformers, SMALL = _transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from models.deepseek_v3.hf import args_from_config
    from models.deepseek_v3.model import MLAttention
    from models.deepseek_v3.yarn import deepseek_rope_tables, yarn_frequencies

    config = transformers.DeepseekV3Config(**{**SMALL, **PUBLISHED_HEADS}, q_lora_rank=None,
                                           rope_scaling=PUBLISHED_YARN)
    config._attn_implementation = "sdpa"  # causal without a mask
    args = args_from_config(config.to_dict())
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got = yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling_factor,
                           args.rope_original_max_seq_len, args.rope_yarn_beta_fast, args.rope_yarn_beta_slow)
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ramp = ((torch.arange(32, dtype=torch.float64) - 10) / (23 - 10)).clamp(0, 1)  # by hand: 0 up to 10, 1 from 23
    assert torch.allclose(got, base / 40 * ramp + base * (1 - ramp), rtol=1e-15, atol=0)
    assert args.rope_attention_factor == want_factor == 1.0
    scale = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
    attention = DeepseekV3Attention(config, layer_idx=0).double()
    assert args.softmax_scale == pytest.approx(scale, rel=1e-12)
    assert attention.scaling == pytest.approx(scale, rel=1e-12)

    ours = MLAttention(args).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mine, hf_name in (("wq", "q_proj"), ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"),
                              ("wkv_b", "kv_b_proj"), ("wo", "o_proj")):
            weight = getattr(attention, hf_name).weight
            weight.copy_(1.0 + 0.2 * torch.randn(weight.shape, generator=g, dtype=torch.float64) if weight.dim() == 1
                         else 0.3 * torch.randn(weight.shape, generator=g, dtype=torch.float64))
            getattr(ours, mine).weight.copy_(weight)
        x = torch.randn(2, 12, 48, generator=g, dtype=torch.float64)
        cos_sin = DeepseekV3RotaryEmbedding(config)(x, torch.arange(12).expand(2, -1))
        want_out, _ = attention(x, position_embeddings=cos_sin, attention_mask=None)
        cos, sin = deepseek_rope_tables(dataclasses.replace(args, max_seq_len=12))
        got_out = ours(x, cos.double(), sin.double())
    # transformers rotates with float32 angles: 1e-5 of the output's scale covers that, not a wrong scale
    assert (got_out - want_out).abs().max().item() < 1e-5 * want_out.abs().max().item()


PUBLISHED_MTP_WEIGHT = 0.3  # DeepSeek-V3 §4.2: λ = 0.3 for the first 10T tokens (then 0.1), depth D = 1


@pytest.fixture(scope="module")
def depth_one():
    """The debug DeepSeek-V3 with the published MTP depth 1, float64, λ = 0.3."""
    from models.deepseek_v3.flavors import deepseek_v3_flavors
    from models.deepseek_v3.model import DeepseekV3Transformer

    torch.manual_seed(0)
    m = DeepseekV3Transformer(dataclasses.replace(deepseek_v3_flavors["debugmodel"], num_nextn_predict_layers=1))
    m.init_weights(seed=3)
    m.double()
    m.mtp_weight = PUBLISHED_MTP_WEIGHT
    return m


@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["unfused", "fused"])
def test_published_mtp_depth_one_objective_is_the_papers_per_token_formula(depth_one, chunk_tokens):
    """DeepSeek-V3 eq. 24-25 at D = 1, λ = 0.3: the step's loss (the objective over the step's T label
    tokens, engine/train/loss.py ``model_loss``) is L_main + λ/D · L_1 with L_1 = -(1/T) Σ log P(t_{i+2})
    over the S - 1 positions that have a token two ahead (the paper's 1/T, not 1/(T - B), which a
    per-depth mean would give), the depth's log-probabilities written out by hand from the logits."""
    import torch.nn.functional as F

    from engine.train.loss import model_loss
    from tests.unit.test_deepseek_v3_mtp import _batch

    m = depth_one
    tokens, labels, _ = _batch(m.model_args.vocab_size, False)
    T = labels.numel()
    h = m.tok_embeddings(tokens)
    for layer in m.layers.values():
        h = layer(h, m.rope_cos, m.rope_sin)
    log_p = F.log_softmax(m.output(m.norm(h)), dim=-1)
    main = -log_p.gather(-1, labels.unsqueeze(-1)).sum() / T
    module = m.mtp["0"]  # position t: [enorm(Emb(t_{t+1})); hnorm(h_t)] -> block -> predicts t_{t+2} = labels[t+1]
    x = module.eh_proj(torch.cat([module.enorm(m.tok_embeddings(tokens[:, 1:])), module.hnorm(h[:, :-1])], -1))
    log_p1 = F.log_softmax(m.output(module.norm(module.block(x, m.rope_cos, m.rope_sin))), dim=-1)
    l_1 = -log_p1.gather(-1, labels[:, 1:].unsqueeze(-1)).sum() / T
    m.mtp_stats.zero_()
    got = model_loss(m, tokens, labels, T, chunk_tokens=chunk_tokens)
    assert torch.allclose(got, main + PUBLISHED_MTP_WEIGHT / 1 * l_1, rtol=1e-12, atol=0), (got.item(), main.item())
    # logged mtp_loss: the depth's mean over its own B·(S - 1) targets
    logged = m.post_optimizer_step()["mtp_loss"][0]
    assert torch.allclose(logged, l_1 * T / (T - labels.shape[0]), rtol=1e-12, atol=0)


def test_goodput_ledger_over_three_attempts_equals_a_hand_count(tmp_path):
    """engine/observe/goodput.py across two restarts (engine/docs/metrics.md's ledger, Llama 3 §3.3.4's "effective
    training time"): checkpoints every 4 steps, 2 s steps in attempt 0, 3 s in 1, 1 s in 2.

    attempt 0: launch at 0, first step at 10; steps 1-7 (productive 14 s), save at step 4 (1.5 s);
        fails at 30 (rank 1 SIGKILL) -> restart 1 resumes from step-4, after a checkpoint.
    attempt 1: ranks start at 33, first step at 40; steps 5-6 (trained again, 6 s), fails at 48 before
        its first save -> restart 2 resumes from step-4 again: it trains 5-6 a second time and 7, which
        attempt 1 never reached (the high-water mark is attempt 0's step 7, not the last attempt's 6).
    attempt 2: starts at 51, first step at 60; steps 5-7 again (3 s), 8-12 productive (5 s), saves at 8
        and 12 (2 s each); ends at 80.
    Hand count: productive 14 + 0 + 5 = 19 s, 7 + 0 + 5 = 12 steps (each step once); trained again
    6 + 3 = 9 s, 2 + 3 = 5 steps; checkpoint 1.5 + 0 + 4 = 5.5 s; start-up 10 + 7 + 9 = 26 s; recovery
    (failure to the next first step) 10 + 12 = 22 s; wall 80 s; goodput 19 / 80."""
    from engine.observe.goodput import AttemptLedger, ledger, summary_text

    state = str(tmp_path)

    def fail(attempt: int, at: float, started_next: float) -> None:  # the launcher's agent's records
        cause = {"cause": "rank 1 ended with signal SIGKILL", "failed_at": at}
        (tmp_path / f"attempt-{attempt}.end.json").write_text(json.dumps({"attempt": attempt, **cause}))
        (tmp_path / f"restart-{attempt + 1}.json").write_text(json.dumps({"attempt": attempt + 1, **cause}))
        (tmp_path / f"attempt-{attempt + 1}.start.json").write_text(
            json.dumps({"attempt": attempt + 1, "started_at": started_next}))

    def run(attempt: int, resumed_from: int, first_step_at: float, steps, seconds: float, saves: dict):
        account = AttemptLedger(state, attempt, launch_time=0.0, resumed_from=resumed_from,
                                clock=lambda: first_step_at)
        for step in steps:
            account.step_started()
            account.step_done(step, seconds)
            if step in saves:
                account.checkpoint(saves[step])
        account.save()
        return account

    first = run(0, 0, 10.0, range(1, 8), 2.0, {4: 1.5})
    fail(0, at=30.0, started_next=33.0)
    second = run(1, 4, 40.0, range(5, 7), 3.0, {})
    assert second.retrained_range() == (5, 7)
    fail(1, at=48.0, started_next=51.0)
    third = run(2, 4, 60.0, range(5, 13), 1.0, {8: 2.0, 12: 2.0})
    assert third.retrained_range() == (5, 7)
    records, summary = ledger(state, [first.record, second.record, third.record], 0.0, end_time=80.0)
    assert [(r["startup_s"], r["recovery_s"], r["wall_s"]) for r in records] == [
        (10.0, None, 30.0), (7.0, 10.0, 15.0), (9.0, 12.0, 29.0)]
    assert [(r["productive_steps"], r["productive_s"], r["retrained_steps"], r["retrained_s"], r["checkpoint_s"])
            for r in records] == [(7, 14.0, [], 0.0, 1.5), (0, 0.0, [5, 6], 6.0, 0.0), (5, 5.0, [5, 6, 7], 3.0, 4.0)]
    assert [r["end"] for r in records] == ["rank 1 ended with signal SIGKILL"] * 2 + ["completed"]
    want = {"productive_s": 19.0, "productive_steps": 12, "retrained_s": 9.0, "retrained_steps": 5,
            "checkpoint_s": 5.5, "startup_s": 26.0, "recovery_s": 22.0, "wall_s": 80.0, "attempts": 3,
            "restarts": 2, "step": 12}
    assert {key: summary[key] for key in want} == want
    assert summary["goodput"] == pytest.approx(19.0 / 80.0, rel=1e-12)
    assert summary_text(summary) == "goodput 23.8 % of 80.0 s wall (2 restarts, 5 steps trained again)"
