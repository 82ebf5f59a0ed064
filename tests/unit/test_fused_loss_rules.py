"""models/common/linear_cross_entropy.py's rules beyond tests/integration/test_fused_loss.py, each against the cross entropy
and PaLM z-loss written in float64 from the logits (log-sum-exp minus the label's logit): float64 inputs
summed in float64, logits of any scale, a frozen head or frozen hidden states, the z-loss callback,
buffers on the inputs' device, one vocab shard's part of the sum, and the tensor-parallel entry
(DTensor weight, plain or sequence-sharded hidden) on a 1-rank gloo mesh in this process (the 2-rank
check is test_fused_loss.py's, in worker processes). Unit level: a few seconds in all."""

from __future__ import annotations

import pytest
import torch

from models.common.linear_cross_entropy import IGNORE_INDEX, _fused_forward, linear_cross_entropy_sum

B, S, DIM, V = 2, 9, 8, 10


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, DIM, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, DIM, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :2] = IGNORE_INDEX
    labels[1, 3], labels[1, 4] = V // 2 - 1, V // 2  # both sides of the vocab shards' border (tp2)
    return hidden, weight, labels


def _oracle(hidden, weight, labels, z_weight=0.0):
    """float64 Σ over label tokens of lse(x) - x_label (+ z_weight lse²), x = hidden @ weight.T."""
    x = hidden.double() @ weight.double().t()
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != IGNORE_INDEX
    picked = x.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return ((lse - picked) * valid).sum() + z_weight * (lse.square() * valid).sum()


def _grads(fn, hidden, weight, labels, trainable=(True, True)):
    h, w = hidden.clone().requires_grad_(trainable[0]), weight.clone().requires_grad_(trainable[1])
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_float64_inputs_are_summed_in_float64():
    """The float64 reference mode: the loss and both gradients to float64 rounding (a float32 buffer
    anywhere would leave ~1e-7)."""
    hidden, weight, labels = _inputs(torch.float64)
    got = _grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 4, z_loss_weight=1e-2), hidden, weight, labels)
    want = _grads(lambda h, w, y: _oracle(h, w, y, 1e-2), hidden, weight, labels)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_logits_of_any_scale_in_one_chunk():
    """Each token's log-sum-exp is shifted by its own max: a token whose logits are all near -1000 and
    one near +1000 in the same chunk (a shared max would underflow the first to log 0)."""
    hidden, weight, labels = _inputs(torch.float64)
    weight[:, 0] = 1.0
    hidden[0, :, 0], hidden[1, :, 0] = 1000.0, -1000.0
    got = linear_cross_entropy_sum(hidden, weight, labels, B * S)
    torch.testing.assert_close(got, _oracle(hidden, weight, labels), rtol=1e-10, atol=0)


@pytest.mark.parametrize("trainable", [(True, False), (False, True)])
def test_a_frozen_head_or_frozen_hidden_states_still_get_the_other_gradient(trainable):
    hidden, weight, labels = _inputs()
    got = _grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 4), hidden, weight, labels, trainable)
    want = _grads(_oracle, hidden, weight, labels, trainable)
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-6, atol=0)
    for a, b, on in zip(got[1:], want[1:], trainable):
        assert (a is None) == (not on)
        if on:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_z_loss_callback_gets_the_z_sum_only_when_the_z_loss_is_on():
    hidden, weight, labels = _inputs(torch.float64)
    seen = []
    linear_cross_entropy_sum(hidden, weight, labels, 4, z_loss_weight=0.0, z_loss_out=seen.append)
    assert seen == []
    linear_cross_entropy_sum(hidden, weight, labels, 4, z_loss_weight=1e-2, z_loss_out=seen.append)
    z_sum = _oracle(hidden, weight, labels, 1e-2) - _oracle(hidden, weight, labels)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], z_sum, rtol=1e-12, atol=0)


def test_buffers_live_on_the_inputs_device():
    """On a 'meta' device (shapes only) every buffer follows the inputs: none is made on the CPU."""
    hidden, weight, labels = (t.to("meta") for t in _inputs())
    loss, grad_hidden, grad_weight = _grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 4), hidden, weight,
                                            labels)
    assert {loss.device.type, grad_hidden.device.type, grad_weight.device.type} == {"meta"}
    assert loss.shape == () and loss.dtype == torch.float32


def test_a_second_backward_is_refused_in_one_line():
    hidden, weight, labels = _inputs()
    loss = linear_cross_entropy_sum(hidden.requires_grad_(), weight.requires_grad_(), labels, 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="^the fused linear cross entropy's backward runs once per forward"):
        loss.backward()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_vocab_shard_sums_its_own_part(rank):
    """tp rank r of 2 holds vocab rows [r V/2, (r+1) V/2): before the tp reductions its sum is, over the
    label tokens, the log-sum-exp over its rows minus the label's logit where it owns the label."""
    hidden, weight, labels = _inputs(torch.float64)
    rows = slice(rank * V // 2, (rank + 1) * V // 2)
    x = hidden.double() @ weight[rows].double().t()
    valid = labels != IGNORE_INDEX
    local = labels - rank * V // 2
    owned = valid & (local >= 0) & (local < V // 2)
    picked = x.gather(-1, local.clamp(0, V // 2 - 1)[..., None]).squeeze(-1)
    want = (torch.logsumexp(x, -1) * valid).sum() - (picked * owned).sum()
    loss, _, _ = _fused_forward(hidden.flatten(0, 1), weight[rows], labels.flatten(), 4, None, rank * V // 2, False)
    assert owned.any() and (valid & ~owned).any()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist

    from engine.planner.real_plan import forget_meshes
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        forget_meshes()  # DTensor's caches hold this mesh: a process forked later crashed clearing them


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_tensor_parallel_entry_on_one_rank(one_rank_mesh, sequence_parallel):
    """A Shard(0) DTensor weight with plain (or Shard(1), sequence-parallel) hidden states: the loss and
    gradients of one process, the weight's gradient a Shard(0) DTensor like the weight."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    hidden, weight, labels = _inputs()
    h = hidden.clone().requires_grad_()
    w = distribute_tensor(weight, one_rank_mesh, [Shard(0)]).requires_grad_()
    h_in = DTensor.from_local(h, one_rank_mesh, [Shard(1)]) if sequence_parallel else h
    loss = linear_cross_entropy_sum(h_in, w, labels, 4)
    loss.backward()
    want = _grads(_oracle, hidden, weight, labels)
    assert type(loss) is torch.Tensor and isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),)
    torch.testing.assert_close(loss.double(), want[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.full_tensor(), want[2], rtol=1e-5, atol=1e-6)
    for placement in (Replicate(), Shard(1)):  # not the vocab rows
        with pytest.raises(ValueError, match="must be vocab-sharded on a 1-D tp mesh"):
            linear_cross_entropy_sum(hidden, distribute_tensor(weight, one_rank_mesh, [placement]), labels, 4)


def test_hidden_states_that_do_not_match_the_labels_are_refused():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"hidden states \(2, 8, 8\) do not match labels \(2, 9\)"):
        linear_cross_entropy_sum(hidden[:, :8], weight, labels, 4)


def _tp_inside_dp(scale: float):
    """On 4 ranks, a [dp 2, tp 2] mesh: each dp replica scores its own batch on its tp pair (the vocab
    reductions must stay inside the tp group), logits shifted by ±``scale`` per token."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hidden, weight, labels = _inputs(torch.float64)
    replica = mesh["dp"].get_local_rank()
    sign = 1 - 2 * replica  # another batch per dp replica: its first row near -scale, the other's near +scale
    weight[:, 0] = 1.0
    hidden[0, :, 0], hidden[1, :, 0] = sign * scale, -sign * scale
    hidden = hidden.roll(replica, dims=1)
    weight = distribute_tensor(weight, mesh["tp"], [Shard(0)])
    loss = linear_cross_entropy_sum(hidden, weight, labels, 4)
    dist.barrier()
    return loss.item(), _oracle(hidden, weight.full_tensor(), labels).item()


def test_vocab_reductions_stay_inside_the_tp_group():
    """4 gloo ranks (tp2 inside dp2): each replica's loss is its own batch's, also with logits near ±1000
    (the log-sum-exp over the tp ranks is shifted by their max). mutmut cannot see the workers' code: it
    maps tests to the functions they call in its own process."""
    from engine.testing.processes import run_distributed

    for loss, want in run_distributed(_tp_inside_dp, 4, 1000.0):
        assert abs(loss - want) <= 1e-10 * abs(want), (loss, want)
