"""The rules of models/common/moe.py that a one-line slip bends without a crash, each against an oracle written
here: the router token by token (softmax / sigmoid of the gate logits, top-k by biased score in descending order,
gate weights from the unbiased scores; Mixtral arXiv 2401.04088, DeepSeek-V3 arXiv 2412.19437 §2.1.2), Python's
stable sort, the per-expert SwiGLU loop, DeepSeek-V3's sequence-wise balance loss by hand (eq. 17-20) on whole
sequences and split over context-parallel ranks, and the layer's statistics counted by hand. Unit level, one
process, a few seconds: the fast selection scripts/mutation.sh runs for this module.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import models.common.moe as layers
from models.common.moe import GroupedExperts, MoE, TokenChoiceRouter, sort_tokens_by_expert
from tests.unit.test_moe import TINY

# 8 experts, 3 slots: enough that the slot order, the bias and the normalisation each change some token's answer.
WIDE = dataclasses.replace(TINY, num_experts=8, top_k=3, route_scale=2.5, load_balance_coeff=0.1)


def _layer(args=WIDE, seed: int = 0, **changes) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(dataclasses.replace(args, **changes))
    layer.init_weights(init_std=0.02, seed=seed, prefix="layers.0.feed_forward")
    torch.nn.init.normal_(layer.router.gate.weight, std=0.5)  # routing far from uniform
    return layer


def _route_by_hand(gate: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, score_func: str,
                   route_norm: bool, route_scale: float, top_k: int):
    """Token by token in float64: scores, the top_k experts by score + bias (descending), their weights."""
    all_ids, all_weights, all_scores = [], [], []
    for token in x.double():
        logits = [float(token @ row) for row in gate.double()]
        if score_func == "softmax":
            top = max(logits)
            exps = [math.exp(v - top) for v in logits]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + (0.0 if bias is None else float(b)) for s, b in zip(scores, bias if bias is not None else scores)]
        ids = sorted(range(len(scores)), key=lambda e: -choice[e])[:top_k]
        weights = [scores[e] for e in ids]
        if route_norm:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append([w * route_scale for w in weights])
        all_scores.append(scores)
    return torch.tensor(all_ids), torch.tensor(all_weights, dtype=torch.float64), torch.tensor(all_scores)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm", [False, True])
def test_router_equals_the_rule_token_by_token(score_func, route_norm):
    layer = _layer(score_func=score_func, route_norm=route_norm)
    router = layer.router
    router.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.2)
    x = torch.randn(96, WIDE.dim, generator=torch.Generator().manual_seed(4))
    weights, ids, scores = router(x)
    want_ids, want_weights, want_scores = _route_by_hand(router.gate.weight.detach(), router.expert_bias, x,
                                                         score_func, route_norm, 2.5, 3)
    assert torch.equal(ids, want_ids)  # slot order: descending biased score
    torch.testing.assert_close(scores.double(), want_scores.double(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-5, atol=1e-7)
    assert weights.dtype == scores.dtype == torch.float32
    # the bias decides some choices here (else the case would not check that it is added)
    plain_ids, _, _ = _route_by_hand(router.gate.weight.detach(), None, x, score_func, route_norm, 2.5, 3)
    assert not torch.equal(plain_ids, want_ids)


def test_bf16_router_scores_in_float32():
    """A bf16 gate's logits are promoted before the softmax: scores and weights are float32."""
    layer = _layer(score_func="softmax")
    router = layer.router.to(torch.bfloat16)
    x = torch.randn(32, WIDE.dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    weights, _, scores = router(x)
    assert scores.dtype == weights.dtype == torch.float32
    logits = F.linear(x, router.gate.weight)  # bf16, as the gate computes it
    torch.testing.assert_close(scores, torch.softmax(logits.float(), dim=-1), rtol=1e-6, atol=1e-7)


def test_checkpointed_buffers():
    """expert_bias exists and is checkpointed only with auxiliary-loss-free balancing; the per-step statistics are
    not checkpointed; no shared experts when n_shared_experts = 0."""
    balanced = _layer(load_balance_coeff=0.1)
    assert "router.expert_bias" in balanced.state_dict()
    plain = _layer(load_balance_coeff=0.0, n_shared_experts=0)
    assert plain.router.expert_bias is None and "router.expert_bias" not in plain.state_dict()
    assert not any(k.startswith("shared_experts") for k in plain.state_dict()) and plain.shared_experts is None
    for name in ("tokens_per_expert", "balance_loss_sum", "dropped_slots"):
        assert name not in balanced.state_dict()
    assert balanced.aux_loss_scale == 1.0  # a sum over sequences until parallelize sets 1 / sequences


def test_sort_is_stable_over_many_ties():
    """Within an expert, slots keep their order (Python's sorted is stable: the oracle)."""
    ids = torch.randint(0, 5, (60, 2), generator=torch.Generator().manual_seed(6))
    ids[::7, 1] = 5  # dropped slots (== num_experts) sort last and are counted nowhere
    order, counts = sort_tokens_by_expert(ids, num_experts=5)
    flat = ids.reshape(-1).tolist()
    assert order.tolist() == sorted(range(len(flat)), key=lambda i: flat[i])
    assert counts.tolist() == [flat.count(e) for e in range(5)]


def _swiglu_loop(x, counts, w1, w2, w3):
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        for r in range(start, start + n):
            rows.append((F.silu(x[r] @ w1[e]) * (x[r] @ w3[e])) @ w2[e])
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("align", [1, 16])
def test_grouped_experts_equal_the_loop_with_remainders(align, monkeypatch):
    """Groups of 1, 17, 0, 5 and 33 rows (remainders 1 and 5 of the CUDA layout's 16-row tiles), 56 rows != dim:
    the output and the gradients of a plain .sum() (an expanded gradient) are the per-row SwiGLU's."""
    monkeypatch.setitem(layers._GROUPED_MM_ALIGN, "cpu", align)
    torch.manual_seed(7)
    experts = GroupedExperts(32, 16, 5)
    experts.init_weights(0.02, 0, "e")
    counts = torch.tensor([1, 17, 0, 5, 33])
    x = torch.randn(56, 32)
    out = experts(x, counts)
    out.sum().backward()
    grads = [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)]
    weights = [w.detach().clone().requires_grad_() for w in (experts.w1, experts.w2, experts.w3)]
    want = _swiglu_loop(x, counts, weights[0], weights[1], weights[2])
    want.sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, weights):
        torch.testing.assert_close(got, ref.grad, rtol=1e-5, atol=1e-6)


def test_grouped_switch_dtype_and_autocast(monkeypatch):
    """use_grouped_mm (on by default) picks the grouped kernel, off the loop; float32 rows meet bf16 experts in
    bf16; under autocast the grouped kernel (which autocast does not cover) runs in autocast's dtype."""
    torch.manual_seed(8)
    experts = GroupedExperts(32, 16, 4)
    experts.init_weights(0.02, 0, "e")
    counts, x = torch.tensor([3, 0, 4, 1]), torch.randn(8, 32)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    want = _swiglu_loop(x, counts, experts.w1, experts.w2, experts.w3)
    torch.testing.assert_close(experts(x, counts), want, rtol=1e-5, atol=1e-6)
    assert calls
    calls.clear()
    experts.use_grouped_mm = False
    torch.testing.assert_close(experts(x, counts), want, rtol=1e-5, atol=1e-6)
    assert not calls
    experts.use_grouped_mm = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
    assert out.dtype == torch.bfloat16 and calls
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=2e-3)
    experts.to(torch.bfloat16)
    out = experts(x, counts)  # float32 rows, bf16 experts
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=2e-3)


def test_grouped_kernel_usable_where_its_documented_limits_allow(monkeypatch):
    """CPU: rows of 16 bytes in both weight dims; no float64; under torch.compile only bf16; meta: never."""
    usable = layers._grouped_mm_usable

    def case(dtype, rows, cols, device="cpu"):
        return usable(torch.empty(4, rows, dtype=dtype, device=device),
                      torch.empty(2, rows, cols, dtype=dtype, device=device))
    assert case(torch.float32, 32, 16) and case(torch.bfloat16, 16, 8)
    assert not case(torch.float32, 30, 16) and not case(torch.float32, 32, 30)  # 120 bytes
    assert not case(torch.bfloat16, 16, 12) and not case(torch.float64, 32, 16)
    assert not case(torch.float32, 32, 16, device="meta")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert case(torch.bfloat16, 16, 8) and not case(torch.float32, 32, 16)


def _balance_by_hand(scores, ids, bsz, seqlen, num_experts, top_k, score_func):
    """Σ over sequences of Σ_i f_i P_i: f_i = E / (K S) · slots choosing i, P_i = mean over the sequence of
    s_i / Σ_j s_j (sigmoid) or of the softmax score (DeepSeek-V3 eq. 17-20)."""
    total = 0.0
    for b in range(bsz):
        rows = range(b * seqlen, (b + 1) * seqlen)
        for i in range(num_experts):
            slots = sum(int((ids[t] == i).sum()) for t in rows)
            probs = [float(scores[t, i] / (scores[t].sum() if score_func == "sigmoid" else 1.0)) for t in rows]
            total += num_experts / (top_k * seqlen) * slots * sum(probs) / seqlen
    return total


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_statistics_count_training_forwards_only(score_func):
    """tokens_per_expert, balance_loss_sum (times aux_loss_scale) and dropped_slots add up over the training
    forwards of a step, by hand; an eval forward adds nothing. The last expert is never chosen (one-hot width)."""
    layer = _layer(score_func=score_func, capacity_factor=1.0)
    layer.router.expert_bias[-1] = -10.0
    layer.aux_loss_scale = 0.25
    counts, balance, dropped = torch.zeros(8), 0.0, 0
    for seed in (9, 10):
        x = torch.randn(2, 8, WIDE.dim, generator=torch.Generator().manual_seed(seed))
        _, ids, scores = layer.router(x.reshape(-1, WIDE.dim))
        capacity = math.ceil(1.0 * 8 * 3 / 8)
        for b in range(2):  # GShard's capacity by hand: earlier tokens win, per sequence
            seen = [0] * 8
            for t in range(b * 8, (b + 1) * 8):
                for e in ids[t].tolist():
                    seen[e] += 1
                    if seen[e] <= capacity:
                        counts[e] += 1
                    else:
                        dropped += 1
        balance += 0.25 * _balance_by_hand(scores.detach(), ids, 2, 8, 8, 3, score_func)
        layer(x)
    assert dropped > 0 and counts[-1] == 0
    assert torch.equal(layer.tokens_per_expert, counts) and int(layer.dropped_slots) == dropped
    assert layer.balance_loss_sum.item() == pytest.approx(balance, rel=1e-5)
    layer.eval()
    layer(torch.randn(2, 8, WIDE.dim))
    assert torch.equal(layer.tokens_per_expert, counts) and int(layer.dropped_slots) == dropped


def test_balance_loss_enters_the_objective_only_in_training():
    x = torch.randn(2, 8, WIDE.dim, generator=torch.Generator().manual_seed(11))
    grads = {}
    for coeff in (0.0, 0.5):
        layer = _layer(score_func="softmax", aux_loss_coeff=coeff)
        layer.eval()
        layer(x).sum().backward()
        grads[coeff] = layer.router.gate.weight.grad
    torch.testing.assert_close(grads[0.5], grads[0.0], rtol=0, atol=0)


def test_context_parallel_shares_add_up_to_the_whole_sequences(monkeypatch):
    """Under cp = 2 each rank holds half of each sequence: the counts f_i are summed over the cp group (here a
    stand-in all_reduce adding the other rank's counts, by hand) and the two ranks' values add up to the loss of
    the whole sequences."""
    layer = _layer(score_func="sigmoid")
    group = object()
    x = torch.randn(2, 8, WIDE.dim, generator=torch.Generator().manual_seed(12))
    halves = [x[:, :4].reshape(-1, WIDE.dim), x[:, 4:].reshape(-1, WIDE.dim)]
    routed = [layer.router(h)[1:] for h in halves]  # (ids, scores) per rank
    whole_ids, whole_scores = layer.router(x.reshape(-1, WIDE.dim))[1:]
    want = _balance_by_hand(whole_scores.detach(), whole_ids, 2, 8, 8, 3, "sigmoid")

    def local_counts(ids):
        return torch.stack([torch.bincount(ids.view(2, 12)[b], minlength=8) for b in range(2)]).float()

    total = 0.0
    for rank in (0, 1):
        other = local_counts(routed[1 - rank][0])

        def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, _other=other):
            assert op == torch.distributed.ReduceOp.SUM and group is layer.cp_group
            tensor += _other

        monkeypatch.setattr(layers.dist, "all_reduce", all_reduce)
        monkeypatch.setattr(layers.dist, "get_world_size", lambda g: 2 if g is group else 1)
        layer.cp_group = group
        ids, scores = routed[rank]
        total += layer._balance_loss(scores, ids, 2, 4).item()
    assert total == pytest.approx(want, rel=1e-5)


def test_init_is_a_function_of_seed_and_name():
    """Each weight is drawn from its own (seed, name) stream (models/common/init.py): the same name gives the same
    weights, another layer's name other weights; w1 ~ N(0, 0.02) whatever init_std, w2 and w3 ~ N(0, init_std)."""
    def build(prefix):
        layer = MoE(WIDE)
        layer.init_weights(init_std=0.005, seed=0, prefix=prefix)
        return dict(layer.named_parameters())
    first, again, other = build("layers.0.feed_forward"), build("layers.0.feed_forward"), build("layers.1.feed_forward")
    for name, value in first.items():
        assert torch.equal(value, again[name]) and not torch.equal(value, other[name]), name
    assert 0.018 < first["experts.w1"].std() < 0.022 and 0.0045 < first["experts.w2"].std() < 0.0055
    assert not torch.equal(first["experts.w2"].flatten(), first["experts.w3"].flatten())


def test_layer_output_keeps_the_input_dtype():
    """x [B, S, dim] bf16 -> bf16 (the combine sums in float32, then casts back)."""
    layer = _layer(score_func="softmax").to(torch.bfloat16)
    layer.experts.use_grouped_mm = False
    out = layer(torch.randn(2, 8, WIDE.dim).bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (2, 8, WIDE.dim)
