"""engine/train/loss.py's rules against closed formulas: the cross entropy and PaLM's z-loss written
from their definitions (log Σ exp, in float64), the per-row sums of evaluation (also from logits that are
a vocab-sharded DTensor under torch's loss_parallel), the z-loss metric's reduction, and which of the
two loss paths (logits, or the model's own token sum) ``model_loss`` and a pipeline's last stage take.
Unit level: stub models of a few lines, one 1-rank gloo group (a few seconds in all)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.train.loss import IGNORE_INDEX, ZLoss, fused_stage_loss, last_stage_loss, model_loss, row_sum_loss

B, S, V = 2, 5, 7


def _batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, S, V, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, 1] = labels[1, 4] = IGNORE_INDEX
    return logits, labels


def _per_token(logits, labels):
    """[B, S] float64: log Σ_v exp(x_v) - x_label (the definition), 0 where the label is -100, and the
    [B, S] log Σ exp itself."""
    x = logits.double()
    lse = x.exp().sum(-1).log()
    scored = labels != IGNORE_INDEX
    picked = x.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(scored, lse - picked, 0.0), torch.where(scored, lse, 0.0)


class _Logits(nn.Module):
    """A model that returns logits [B, S, V] (a table lookup); ``shift`` stands for a model keyword input
    (document masking's ids and positions): it changes the output. Takes no labels."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(V + 2, S, V, generator=torch.Generator().manual_seed(1)))

    def forward(self, inputs, shift: int = 0):
        return self.table[inputs + shift, torch.arange(inputs.shape[1])]


class _TokenSum(_Logits):
    """A model that returns its own token sum (the fused loss, or an objective needing the labels):
    the cross entropy sum of the same logits, recording the chunk size it was given."""

    def forward(self, inputs, *, labels, loss_chunk_tokens, shift: int = 0):
        self.chunk_tokens = loss_chunk_tokens
        logits = super().forward(inputs, shift)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _inputs():
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))


def test_row_sum_loss_is_minus_each_rows_log_likelihood():
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        logits, labels = _batch(dtype)
        rows = row_sum_loss(logits, labels)
        # bf16 logits are scored in float32 (a bf16 softmax is ~1e-2 off): the oracle takes the same values
        assert rows.dtype == torch.float64 and rows.shape == (B,)
        torch.testing.assert_close(rows, _per_token(logits, labels)[0].sum(1), rtol=rtol, atol=0)


def test_row_sum_loss_of_vocab_sharded_logits_is_the_plain_one():
    """Under loss_parallel the per-token losses are a replicated DTensor: their local value is taken."""
    import torch.distributed as dist

    from engine.planner.real_plan import forget_meshes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        logits, labels = _batch()
        sharded = distribute_tensor(logits, init_device_mesh("cpu", (1,)), [Shard(2)])
        with loss_parallel():
            rows = row_sum_loss(sharded, labels)
        assert type(rows) is torch.Tensor
        torch.testing.assert_close(rows, _per_token(logits, labels)[0].sum(1), rtol=1e-5, atol=0)
    finally:
        dist.destroy_process_group()
        forget_meshes()  # DTensor's caches hold this mesh: a process forked later crashed clearing them


def test_z_loss_metric_is_the_ranks_token_sum_over_the_global_tokens():
    z_loss = ZLoss(1e-2)
    z_loss.add(torch.tensor(3.0, dtype=torch.float64, requires_grad=True))
    z_loss.add(torch.tensor(1.5, dtype=torch.float64))
    seen = []
    two_ranks = lambda t: (seen.append(t), t * 2)[1]  # noqa: E731  (the same sum on 2 ranks)
    assert z_loss.step_mean(two_ranks, torch.tensor(9.0), "cpu") == pytest.approx(2 * 4.5 / 9)
    # every rank hands the collective a float32 on its device, also one without a z-loss this step (a
    # pipeline stage without the head) or one in the float64 reference mode: dtypes must agree
    assert seen[0].dtype == torch.float32 and not seen[0].requires_grad
    assert z_loss.take() == 0.0 and z_loss.take() == 0.0  # cleared: a step starts from nothing
    assert z_loss.step_mean(two_ranks, torch.tensor(9.0), "cpu") == 0.0
    z_loss.add(torch.tensor(1.0))
    placed = []
    z_loss.step_mean(lambda t: (placed.append(t.device), torch.ones(()))[1], 1.0, "meta")
    assert placed == [torch.device("meta")]
    off = ZLoss(0.0)
    off.add(torch.tensor(2.0))
    called = []
    assert off.step_mean(lambda t: called.append(t), 1.0, "cpu") is None and not called  # no collective
    assert off.take() == 0.0


def test_the_logits_path_is_the_cross_entropy_and_z_loss_formula():
    """model_loss with chunk_tokens 0 on a model that returns logits: (Σ CE + w Σ lse²) / global tokens,
    the z-loss only in grad mode and counted in the ZLoss; the model keyword inputs reach the model."""
    model, inputs = _Logits(), _inputs()
    labels = _batch()[1]
    for shift in (0, 2):
        ce, lse = _per_token(model(inputs, shift=shift), labels)
        got = model_loss(model, inputs, labels, shift=shift)  # global_tokens 1: the plain token sum
        torch.testing.assert_close(got.double(), ce.sum(), rtol=1e-6, atol=0)
        z_loss = ZLoss(1e-2)
        got = model_loss(model, inputs, labels, torch.tensor(8.0), z_loss=z_loss, shift=shift)
        torch.testing.assert_close(got.double(), (ce.sum() + 1e-2 * lse.square().sum()) / 8, rtol=1e-6, atol=0)
        torch.testing.assert_close(z_loss.take().double(), 1e-2 * lse.square().sum(), rtol=1e-6, atol=0)
        with torch.no_grad():  # evaluation: the cross entropy alone, nothing counted
            got = model_loss(model, inputs, labels, torch.tensor(8.0), z_loss=z_loss, shift=shift)
        torch.testing.assert_close(got.double(), ce.sum() / 8, rtol=1e-6, atol=0)
        assert z_loss.take() == 0.0


@pytest.mark.parametrize("chunk_tokens, needs_labels", [(1, False), (16, False), (0, True), (16, True)])
def test_the_model_token_sum_path(chunk_tokens, needs_labels):
    """chunk_tokens > 0 or a model that needs the labels: the model gets the labels, the chunk size and its
    keyword inputs, and returns the token sum, divided here by the global tokens."""
    model, inputs = _TokenSum(), _inputs()
    labels = _batch()[1]
    model.needs_labels = needs_labels
    for shift in (0, 2):
        ce = _per_token(_Logits.forward(model, inputs, shift), labels)[0].sum()
        got = model_loss(model, inputs, labels, torch.tensor(8.0), chunk_tokens=chunk_tokens, shift=shift)
        torch.testing.assert_close(got.double(), ce / 8, rtol=1e-6, atol=0)
        assert model.chunk_tokens == chunk_tokens


def test_a_plain_model_is_called_without_labels():
    model = _Logits()
    model.needs_labels = False
    assert model_loss(model, _inputs(), _batch()[1]).ndim == 0  # _Logits.forward takes no labels


def test_a_pipeline_last_stage_takes_the_same_path():
    """last_stage_loss: the model token sum (takes_labels, divided by the global tokens) with the fused loss
    or an objective needing the labels; else the logits' cross entropy with the run's z-loss."""
    z_loss = ZLoss(1e-2)
    for chunk, parts in ((1, []), (16, []), (0, [object()]), (16, [object()])):
        context = types.SimpleNamespace(loss_chunk_tokens=chunk, window_parts=parts, z_loss=z_loss)
        takes_labels, loss_fn = last_stage_loss(context)
        assert takes_labels and loss_fn(torch.tensor(6.0), _batch()[1], global_tokens=4) == 1.5
    takes_labels, loss_fn = last_stage_loss(types.SimpleNamespace(loss_chunk_tokens=0, window_parts=[], z_loss=z_loss))
    logits, labels = _batch()
    ce, lse = _per_token(logits, labels)
    assert not takes_labels
    got = loss_fn(logits.requires_grad_(), labels, global_tokens=torch.tensor(8.0))
    torch.testing.assert_close(got.double(), (ce.sum() + 1e-2 * lse.square().sum()) / 8, rtol=1e-6, atol=0)
    assert z_loss.take() != 0.0


def test_fused_stage_loss_default_is_the_plain_token_sum():
    assert fused_stage_loss(torch.tensor(6.0), _batch()[1]) == 6.0
