"""The chunked, fused linear cross entropy (models/common/linear_cross_entropy.py) equals today's loss:
``F.cross_entropy`` over full logits (engine/train/loss.py ``token_sum_loss``).

- the function itself, fp32: loss relative 1e-6, gradients of hidden states and weight 1e-5, with
  ignored (-100) tokens, chunk sizes that do and do not divide the token count, and tied embeddings;
- under tensor parallel (2 gloo ranks): vocab-sharded weight, with and without sequence parallel;
- a whole training run: one process with the fused loss (the ``reference`` of every parity test,
  tests/conftest.py) against one process with the unfused loss, loss 1e-6 and grad norm 1e-5 at every
  step, validation 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.train.loss import token_sum_loss
from models.common.linear_cross_entropy import linear_cross_entropy_sum
from engine.testing.processes import run_distributed
from tests.training_utils import base_args, train_and_record

B, S, DIM, VOCAB = 2, 37, 16, 102


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, DIM, generator=gen)
    weight = torch.randn(VOCAB, DIM, generator=gen) * 0.5
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return hidden, weight, labels


def _loss_and_grads(loss_fn, hidden, weight, labels):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def _unfused(hidden, weight, labels, global_tokens=1.0):
    return token_sum_loss(hidden @ weight.t(), labels, global_tokens)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_tokens", [1, 16, 37, 74, 4096])
def test_fused_equals_unfused_loss_and_gradients(chunk_tokens):
    hidden, weight, labels = _inputs()
    global_tokens = 55.0  # as the trainer divides by the step's label tokens
    want = _loss_and_grads(lambda h, w, y: _unfused(h, w, y, global_tokens), hidden, weight, labels)
    got = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, chunk_tokens) / global_tokens,
                          hidden, weight, labels)
    assert abs(got[0] - want[0]) <= 1e-6 * want[0], (got[0], want[0])
    assert _rel(got[1], want[1]) <= 1e-5 and _rel(got[2], want[2]) <= 1e-5
    # ignored tokens get no gradient
    assert got[1][0, :5].abs().max() == 0 and got[1][1, -3:].abs().max() == 0


@pytest.mark.parametrize("precision", ["autocast", "bf16_parameters"])
def test_bf16_matches_unfused_to_bf16_rounding(precision):
    """Mixed precision: bf16 logits under autocast (fp32 hidden and weight), or bf16 hidden and
    weight (FSDP's param_dtype). The loss is computed in fp32 from the same bf16 logits; the weight
    gradient is summed over chunks in fp32 from bf16 chunk products (one bf16 rounding apart)."""
    hidden, weight, labels = _inputs()

    def loss_fn(fused):
        def run(h, w, y):
            if precision == "bf16_parameters":
                h, w = h.bfloat16(), w.bfloat16()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                return linear_cross_entropy_sum(h, w, y, 16) if fused else _unfused(h, w, y)
        return run

    want = _loss_and_grads(loss_fn(False), hidden, weight, labels)
    got = _loss_and_grads(loss_fn(True), hidden, weight, labels)
    assert abs(got[0] - want[0]) <= 1e-6 * want[0], (got[0], want[0])
    assert _rel(got[1], want[1]) <= 1e-2 and _rel(got[2], want[2]) <= 1e-2


def test_tied_embeddings_get_both_gradients():
    """The tied matrix's gradient is the embedding's plus the output's, as with full logits."""
    from models.common.args import LlamaModelArgs
    from models.common.decoder import Transformer

    args = LlamaModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=VOCAB, max_seq_len=S, tie_embeddings=True)
    grads = []
    for fused in (False, True):
        model = Transformer(args)
        model.init_weights(seed=0)
        assert model.output.weight is model.tok_embeddings.weight
        tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = -100
        loss = model(tokens, labels=labels, loss_chunk_tokens=10) if fused else token_sum_loss(model(tokens), labels)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_loss, want), (got_loss, got) = grads
    assert abs(got_loss - want_loss) <= 1e-6 * want_loss
    for name, grad in want.items():
        assert _rel(got[name], grad) <= 1e-5, name


def test_evaluation_computes_no_gradients(monkeypatch):
    """Under no_grad (validation) only the log-sum-exp pass runs, and the value is the same."""
    import models.common.linear_cross_entropy as lce

    hidden, weight, labels = _inputs()
    real, grads = lce._chunk, []
    monkeypatch.setattr(lce, "_chunk", lambda *a: grads.append(a[-1]) or real(*a))
    with torch.no_grad():
        got = linear_cross_entropy_sum(hidden, weight.requires_grad_(), labels, 16)
    assert grads == [None] * 5  # 74 tokens in 5 chunks, no gradient buffers
    assert abs(got - _unfused(hidden, weight.detach(), labels)) <= 1e-6 * got


def test_split_backward_inputs_then_weights():
    """Zero-bubble pipeline schedules take the gradient of the stage inputs first and of the weights
    later, from the same graph (torch.distributed.pipelining's stage_backward_input / _weight)."""
    hidden, weight, labels = _inputs()
    want = _loss_and_grads(_unfused, hidden, weight, labels)
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_sum(hidden, weight, labels, 16)
    (grad_hidden,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (grad_weight,) = torch.autograd.grad(loss, weight, retain_graph=True)
    assert _rel(grad_hidden, want[1]) <= 1e-5 and _rel(grad_weight, want[2]) <= 1e-5
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


def test_refuses_a_chunk_size_below_one():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        linear_cross_entropy_sum(hidden, weight, labels, 0)


def _tp_fused(sequence_parallel: bool):
    """On each of 2 tp ranks: the fused loss on the vocab-sharded weight; returns (loss, full hidden
    gradient, full weight gradient) gathered to every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    hidden, weight, labels = _inputs()
    weight = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    if sequence_parallel:  # [B, S/tp, dim] shards on the tp ranks (S even here)
        full = hidden[:, :36].clone().requires_grad_()
        local = full.chunk(2, dim=1)[dist.get_rank()].detach().requires_grad_()
        from torch.distributed.tensor import DTensor

        h_in, y = DTensor.from_local(local, mesh, [Shard(1)]), labels[:, :36]
    else:
        local = hidden.clone().requires_grad_()
        h_in, y = local, labels
    loss = linear_cross_entropy_sum(h_in, weight, y, 10)
    loss.backward()
    grad_hidden = local.grad
    if sequence_parallel:
        parts = [torch.empty_like(grad_hidden) for _ in range(2)]
        dist.all_gather(parts, grad_hidden.contiguous())
        grad_hidden = torch.cat(parts, dim=1)
    # numpy: torch tensors would travel through shared memory the worker frees when it exits
    return loss.item(), grad_hidden.numpy(), weight.grad.full_tensor().numpy()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_equals_one_process(sequence_parallel):
    results = run_distributed(_tp_fused, 2, sequence_parallel)
    hidden, weight, labels = _inputs()
    if sequence_parallel:
        hidden, labels = hidden[:, :36], labels[:, :36]
    want = _loss_and_grads(_unfused, hidden, weight, labels)
    for loss, grad_hidden, grad_weight in results:
        assert math.isclose(loss, want[0].item(), rel_tol=1e-6)
        assert _rel(torch.from_numpy(grad_hidden), want[1]) <= 1e-5
        assert _rel(torch.from_numpy(grad_weight), want[2]) <= 1e-5


def test_fused_run_equals_unfused_run(reference, tmp_path):
    """One process, 5 steps with clipping and validation: the fused loss (the parity tests'
    reference) against the unfused one. Every parity test compares its layouts with the fused run."""
    (unfused,) = run_distributed(train_and_record, 1, base_args(str(tmp_path), {"loss.chunk_tokens": 0}),
                                 torchrun_env=False)
    assert len(unfused) == len(reference)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(reference, unfused), start=1):
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), f"step {step}: loss {loss} vs unfused {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs unfused {ref_norm}"
    assert [s for s, _ in reference.validation] == [s for s, _ in unfused.validation]
    for (step, loss), (_, ref_loss) in zip(reference.validation, unfused.validation):
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), f"validation after step {step}: {loss} vs {ref_loss}"


def test_z_loss_fused_equals_unfused_in_value_and_gradients():
    """PaLM's z-loss (weight x logsumexp^2 per label token) inside the chunked loss equals the unfused
    loss's at fp32 tolerance, value and both gradients, and the value is the formula's (fp64)."""
    from engine.train.loss import ZLoss, token_sum_loss
    from models.common.linear_cross_entropy import linear_cross_entropy_sum

    weight_z = 0.01
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 10, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen)
    labels = torch.randint(0, 50, (2, 10), generator=gen)
    labels[0, :3] = -100
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        z = ZLoss(weight_z)
        if fused:
            loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=7, z_loss_weight=weight_z, z_loss_out=z.add)
        else:
            loss = token_sum_loss(h @ w.T, labels, z_loss=z)
        loss.backward()
        results.append((loss.detach(), z.take(), h.grad, w.grad))
    for got, want in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits = (hidden @ weight.T).double()
    valid = labels != -100
    lse = torch.logsumexp(logits, dim=-1)
    z_want = weight_z * (lse.square() * valid).sum()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert z_want > 0.1  # the term is not negligible at this weight
    torch.testing.assert_close(results[0][1].double(), z_want, rtol=1e-5, atol=0)
    torch.testing.assert_close(results[0][0].double(), ce + z_want, rtol=1e-5, atol=0)
