"""MoE model, one process: token permutation, router, experts against a dense per-token reference,
capacity, balance loss and bias, activation checkpointing, flavors' parameter counts, validation."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from models import get_model_args, get_model_spec
from models.common.moe_args import MoEModelArgs
from models.moe.flavors import moe_flavors
from models.common.moe import MoE, capacity_keep_mask, combine_expert_outputs, sort_tokens_by_expert
from models.common.moe_decoder import MoETransformer
from parallelisms.expert_parallel import ExpertParallelError, regroup_by_local_expert
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.tensor_parallel import TensorParallelError

TINY = MoEModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16,
    num_experts=4, top_k=2, moe_inter_dim=16, n_shared_experts=1, n_dense_layers=0,
    score_func="sigmoid", route_norm=True, route_scale=1.5,
)


def build_layer(**changes) -> MoE:
    torch.manual_seed(0)
    layer = MoE(dataclasses.replace(TINY, **changes))
    layer.init_weights(init_std=0.02, seed=0, prefix="layers.0.feed_forward")
    # Larger gate weights than the init, so that routing is far from uniform and ties.
    torch.nn.init.normal_(layer.router.gate.weight, std=0.5)
    return layer


def dense_reference(layer: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: Σ_k w_k · SwiGLU_{e_k}(x_t) (+ shared experts), with plain matmuls."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids, _ = layer.router(tokens)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    rows = []
    for t in range(tokens.shape[0]):
        out = torch.zeros(x.shape[-1])
        for k in range(ids.shape[1]):
            if keep is not None and not keep[t, k]:
                continue
            e = ids[t, k]
            h = torch.nn.functional.silu(tokens[t] @ w1[e]) * (tokens[t] @ w3[e])
            out = out + weights[t, k] * (h @ w2[e])
        rows.append(out)
    out = torch.stack(rows).view_as(x)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


# ---------------------------------------------------------------------------- pure permutation
def test_sort_groups_slots_by_expert_and_combine_inverts_it():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    order, counts = sort_tokens_by_expert(ids, num_experts=4)
    assert counts.tolist() == [3, 2, 3, 0]  # expert 3 empty
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert (order // 2).tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # stable: token order within an expert
    expert_out = torch.arange(8.0).unsqueeze(1)  # output of the i-th sorted slot = i
    weights = torch.tensor([[1.0, 10.0], [1.0, 10.0], [1.0, 10.0], [1.0, 10.0]])
    combined = combine_expert_outputs(expert_out, order, weights)
    # token 0: slot (0, expert 2) is sorted 5th, slot (1, expert 0) 0th -> 5 + 10 * 0
    assert combined.squeeze(1).tolist() == [5.0, 1 + 10 * 3, 6 + 10 * 4, 2 + 10 * 7]


def test_all_slots_to_one_expert_and_dropped_slots():
    ids = torch.full((5, 1), 3)
    order, counts = sort_tokens_by_expert(ids, num_experts=4)
    assert counts.tolist() == [0, 0, 0, 5] and order.tolist() == [0, 1, 2, 3, 4]
    ids = torch.tensor([[1], [4], [1], [4]])  # 4 == num_experts marks a dropped slot
    order, counts = sort_tokens_by_expert(ids, num_experts=4)
    assert counts.tolist() == [0, 2, 0, 0] and order[:2].tolist() == [0, 2]
    out = combine_expert_outputs(torch.ones(2, 3), order, torch.ones(4, 1))
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_capacity_counts_each_sequence_in_token_order():
    # 2 sequences of 3 tokens, top-1, capacity 1: the first token of each sequence per expert wins.
    ids = torch.tensor([[0], [0], [1], [1], [0], [1]])
    keep = capacity_keep_mask(ids, seq_len=3, num_experts=2, capacity=1)
    assert keep.squeeze(1).tolist() == [True, False, True, True, True, False]


def test_regroup_by_local_expert():
    # Received from 2 sources for 2 local experts: [src0: e0 x2, e1 x1][src1: e0 x1, e1 x0].
    counts = torch.tensor([[2, 1], [1, 0]])
    index = regroup_by_local_expert(counts)
    received = torch.tensor([10, 11, 12, 20])  # src0-e0, src0-e0, src0-e1, src1-e0
    assert received[index].tolist() == [10, 11, 20, 12]
    assert regroup_by_local_expert(torch.zeros(2, 2, dtype=torch.long)).numel() == 0


# ---------------------------------------------------------------------------- router and layer
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm", [False, True])
def test_router_weights_and_bias(score_func, route_norm):
    layer = build_layer(score_func=score_func, route_norm=route_norm, load_balance_coeff=0.1)
    x = torch.randn(6, TINY.dim)
    weights, ids, scores = layer.router(x)
    expected = scores.topk(2, dim=-1).indices
    assert torch.equal(ids, expected)
    plain = scores.gather(-1, ids)
    if route_norm:
        plain = plain / plain.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, plain * 1.5)
    # A large bias on expert 3 makes every token choose it, but its gate weight stays the score's.
    layer.router.expert_bias[3] = 10.0
    weights, ids, scores = layer.router(x)
    assert (ids[:, 0] == 3).all()
    raw = scores.gather(-1, ids)
    if route_norm:
        raw = raw / raw.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, raw * 1.5)


@pytest.mark.parametrize("path", ["grouped_mm", "grouped_mm_padded", "loop"])
def test_moe_forward_equals_dense_reference(path, monkeypatch):
    layer = build_layer()
    if path == "loop":
        layer.experts.use_grouped_mm = False
    if path == "grouped_mm_padded":  # the CUDA layout: groups padded to 16 rows
        monkeypatch.setitem(__import__("models.common.moe").common.moe._GROUPED_MM_ALIGN, "cpu", 16)
    x = torch.randn(2, 8, TINY.dim)
    torch.testing.assert_close(layer(x), dense_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_grouped_and_loop_paths_give_the_same_gradients_and_empty_experts_get_zeros():
    grads = {}
    for grouped in (True, False):
        layer = build_layer(n_shared_experts=0)
        layer.router.expert_bias = torch.tensor([0.0, 0.0, 5.0, 5.0])  # experts 0 and 1 get nothing
        layer.router.route_norm = True
        layer.experts.use_grouped_mm = grouped
        layer(torch.randn(2, 8, TINY.dim, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        grads[grouped] = [p.grad.clone() for p in (layer.experts.w1, layer.experts.w2, layer.router.gate.weight)]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    w1_grad = grads[True][0]
    assert w1_grad[:2].abs().sum() == 0 and w1_grad[2:].abs().sum() > 0


def test_capacity_factor_drops_and_counts_overflow():
    layer = build_layer(capacity_factor=0.5)  # capacity ceil(0.5 * 8 * 2 / 4) = 2 per sequence
    x = torch.randn(2, 8, TINY.dim)
    weights, ids, _ = layer.router(x.reshape(-1, TINY.dim))
    keep = capacity_keep_mask(ids, seq_len=8, num_experts=4, capacity=2)
    out = layer(x)
    assert int(layer.dropped_slots) == int((~keep).sum()) > 0
    assert int(layer.tokens_per_expert.sum()) == int(keep.sum())
    torch.testing.assert_close(out, dense_reference(layer, x, keep), rtol=1e-5, atol=1e-6)


def test_balance_loss_is_added_to_the_objective():
    coeff = 0.3
    x = torch.randn(3, 8, TINY.dim)
    layer = build_layer(aux_loss_coeff=coeff, score_func="softmax")
    layer.aux_loss_scale = 1 / 3
    layer(x).sum().backward()
    got = layer.router.gate.weight.grad.clone()
    # The same objective written out: output sum + coeff * mean over sequences of the balance loss.
    ref = build_layer(aux_loss_coeff=0.0, score_func="softmax")
    tokens = x.reshape(-1, TINY.dim)
    _, ids, scores = ref.router(tokens)
    (ref(x).sum() + coeff * _balance_loss_by_hand(scores, ids, 3, 8, ref.num_experts, ref.top_k) / 3).backward()
    torch.testing.assert_close(got, ref.router.gate.weight.grad)
    assert not torch.equal(got, build_grad_without_aux(x))


def _balance_loss_by_hand(scores, expert_ids, bsz: int, seqlen: int, num_experts: int, top_k: int):
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437, eq. 17-20), summed over sequences,
    written loop by loop: for each sequence, Σ_i f_i · P_i with f_i = E / (K·S) · (slots choosing
    expert i) and P_i the sequence mean of the softmax score of expert i."""
    total = 0.0
    for b in range(bsz):
        rows = range(b * seqlen, (b + 1) * seqlen)
        for i in range(num_experts):
            slots = sum(int((expert_ids[t] == i).sum()) for t in rows)
            f_i = num_experts / (top_k * seqlen) * slots
            p_i = sum(scores[t, i] for t in rows) / seqlen
            total = total + f_i * p_i
    return total


def test_balance_loss_is_one_per_sequence_when_routing_is_uniform():
    """The property the formula is built for: uniform scores and an even choice give exactly 1."""
    layer = build_layer(score_func="softmax")
    bsz, seqlen, experts, top_k = 2, 4, layer.num_experts, layer.top_k
    scores = torch.full((bsz * seqlen, experts), 1.0 / experts)
    ids = torch.stack([torch.arange(t * top_k, (t + 1) * top_k) % experts for t in range(bsz * seqlen)])
    assert seqlen * top_k % experts == 0  # every expert gets the same number of slots per sequence
    assert layer._balance_loss(scores, ids, bsz, seqlen).item() == pytest.approx(bsz)


def build_grad_without_aux(x):
    layer = build_layer(aux_loss_coeff=0.0, score_func="softmax")
    layer(x).sum().backward()
    return layer.router.gate.weight.grad


def test_bias_moves_toward_balance_on_skewed_input():
    args = dataclasses.replace(TINY, load_balance_coeff=0.01, n_layers=1, score_func="sigmoid")
    torch.manual_seed(0)
    model = MoETransformer(args)
    model.init_weights(seed=0)
    moe = model.moe_layers()[0]
    with torch.no_grad():  # a skewed router: tokens crowd onto a few experts
        moe.router.gate.weight.normal_(std=0.3)
        moe.router.gate.weight[0] += 0.05
    x = torch.randn(4, 8, TINY.dim) + 0.5
    cvs, first_counts = [], None
    for _ in range(40):  # one "optimizer step" per forward, on the same skewed batch
        moe(x)
        first_counts = moe.tokens_per_expert.clone() if first_counts is None else first_counts
        cvs.append(float(model.post_optimizer_step()["moe_tokens_per_expert_cv"][0]))
    bias = moe.router.expert_bias
    assert cvs[-1] < 0.3 * cvs[0], cvs
    assert bias.argmin() == first_counts.argmax() and bias.argmax() == first_counts.argmin(), (bias, first_counts)
    assert float(moe.tokens_per_expert.sum()) == 0.0  # reset after each step


def test_activation_checkpointing_counts_tokens_once():
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    model = MoETransformer(TINY)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, "full", "op")
    model(torch.randint(0, 64, (2, 8))).float().square().mean().backward()
    for moe in model.moe_layers():
        assert float(moe.tokens_per_expert.sum()) == 2 * 8 * TINY.top_k


# ---------------------------------------------------------------------------- flavors and errors
FLAVOR_COUNTS = {
    "debugmodel": (6_136_064, 4_366_592),
    "debugmodel_mixtral": (6_039_808, 3_680_512),
    # 2·4096·64 embedding + output; per layer 12,288 attention + 128 norms; dense layer 3·64·192;
    # MoE layer 64·8 router + 8·3·64·32 experts (2 active) + 3·64·32 shared; final norm 64.
    "debugmodel_tiny": (778_304, 667_712),
    "debugmodel_mixtral_tiny": (772_672, 625_216),
    "16B": (15_788_259_328, 2_742_925_312),
    "mixtral_8x7b": (46_702_792_704, 12_879_925_248),
}


@pytest.mark.parametrize("flavor", sorted(FLAVOR_COUNTS))
def test_flavor_parameter_counts(flavor):
    args = moe_flavors[flavor]
    with torch.device("meta"):
        model = MoETransformer(args)
    assert args.count_params(model) == FLAVOR_COUNTS[flavor]
    nparams = sum(p.numel() for p in model.parameters())
    flops = get_model_spec("moe").get("flops_per_token")(args, 256)
    total, active = FLAVOR_COUNTS[flavor]
    embedding = args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 256
    assert (nparams, flops) == (total, 6 * (active - embedding) + attention)  # MFU uses active


def parallelism(**changes):
    settings = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, sequence_parallel=True,
                    loss_parallel=True, async_tp=False)
    settings.update(changes)
    return types.SimpleNamespace(**settings)


def _validate_moe(args, **changes):
    get_model_spec("moe").validate_parallelism_fn(args, parallelism(**changes), seq_len=64, device_type="cpu",
                                                  compile_enabled=False)


DEBUG = moe_flavors["debugmodel"]
BAD_SETTINGS = {
    "num_experts % ep": (
        lambda: _validate_moe(DEBUG, ep=3),
        ExpertParallelError, r"parallelism.ep = 3 does not divide the model's num_experts = 8.*\[1, 2, 4, 8\]",
    ),
    "top_k > num_experts": (
        lambda: dataclasses.replace(DEBUG, top_k=9).validate(), ValueError, "top_k=9 exceeds num_experts=8",
    ),
    "no MoE layer": (
        lambda: dataclasses.replace(DEBUG, n_dense_layers=4).validate(), ValueError, "n_dense_layers=4 leaves no MoE",
    ),
    "ep does not divide dp_shard x cp": (
        lambda: ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=4, world_size=4),
        ParallelismError, r"parallelism.ep = 4 must divide dp_shard×cp = 2.*one of \[1, 2\]",
    ),
    "shared experts % tp": (
        lambda: _validate_moe(dataclasses.replace(DEBUG, moe_inter_dim=6), tp=4),
        TensorParallelError, r"parallelism.tp = 4 does not divide the model's shared experts' width .* = 6",
    ),
    "ep with a dense model": (
        lambda: get_model_spec("llama").validate_parallelism_fn(
            get_model_args("llama", "debugmodel"), parallelism(ep=2), seq_len=64, device_type="cpu",
            compile_enabled=False),
        ExpertParallelError, r'parallelism.ep = 2: model.name = "llama" is dense.*model.name = "moe"',
    ),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_validation_errors_name_setting_value_and_fix(case):
    check, error, message = BAD_SETTINGS[case]
    with pytest.raises(error, match=message):
        check()


def test_valid_expert_and_tensor_parallel_settings_pass():
    _validate_moe(DEBUG, ep=4, tp=2)
