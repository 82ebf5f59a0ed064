"""The training loss: token-sum cross entropy over a step's global label-token count."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from models.common.linear_cross_entropy import z_loss_token_sum

IGNORE_INDEX = -100  # label value that contributes neither loss nor a token to the count


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor | float = 1.0,
                   z_loss=None) -> torch.Tensor:
    """Σ cross entropy (nats) over the label tokens of ``logits`` [B, S, V] / ``labels`` [B, S],
    divided by ``global_tokens`` (the step's label-token count over all ranks and microbatches).

    Summing this over every microbatch of every data-parallel rank gives the mean token loss of the
    global batch, so gradients do not depend on how the batch is split (engine/train/trainer.py). With the
    default ``global_tokens = 1`` it is the plain token sum (evaluation). Computed in float32, or
    float64 for float64 logits (the float64 reference mode). ``z_loss`` (a :class:`ZLoss`): in training
    (grad mode on) adds PaLM's ``weight * logsumexp(logits)^2`` per label token (Chowdhery et al. 2022,
    Sec. 5); under ``torch.no_grad()`` (evaluation, e.g. a pipeline's last stage in validation) it is
    neither added nor counted, as the models' own heads do: validation reports the cross entropy alone.
    """
    flat = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    # Equivalent mutants here and in row_sum_loss: labels.flatten(0) is flatten(0, 1) for labels [B, S];
    # IGNORE_INDEX is also F.cross_entropy's default ignore_index (-100), so leaving it out changes nothing.
    loss_sum = F.cross_entropy(flat, labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX)
    if z_loss is not None and z_loss.weight and torch.is_grad_enabled():
        z_sum = z_loss_token_sum(flat, labels.flatten(0, 1), z_loss.weight)
        z_loss.add(z_sum)
        loss_sum = loss_sum + z_sum
    return loss_sum / global_tokens


def row_sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Float64 [B]: the cross-entropy sum (nats) over the label tokens of each row of ``logits``
    [B, S, V] / ``labels`` [B, S] (-100: not scored), i.e. minus each row's log-likelihood of its
    labels. Logits sharded on the vocabulary (a DTensor under ``loss_parallel()``) give per-token
    losses replicated on the tp mesh (torch.distributed.tensor.parallel.loss_parallel,
    ``reduction="none"``), of which this takes the local value."""
    flat = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    per_token = F.cross_entropy(flat, labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX)
    if hasattr(per_token, "full_tensor"):  # a DTensor: replicated per-token losses
        per_token = per_token.full_tensor()
    return per_token.view(labels.shape).double().sum(dim=1)


class ZLoss:
    """PaLM's z-loss of a run (Chowdhery et al. 2022, Sec. 5: ``weight * logsumexp(logits)^2`` per label
    token, keeping the softmax normaliser near 1): its ``weight`` (``[loss] z_loss_weight``) and the
    detached token sum of the current step, for the metrics (``take`` returns and clears it)."""

    def __init__(self, weight: float) -> None:
        self.weight = float(weight)
        self.total = 0.0

    def add(self, z_sum: torch.Tensor) -> None:
        """Add a microbatch's z-loss token sum (0-dim; detached here)."""
        self.total = self.total + z_sum.detach()

    def take(self):
        """The step's z-loss token sum (a 0-dim tensor, or 0.0 when none was added); clears it."""
        total, self.total = self.total, 0.0
        return total

    def step_mean(self, reduce, global_tokens: torch.Tensor, device) -> float | None:
        """The step's z-loss per label token, ``reduce`` summing the token sum over the ranks (dp, pp),
        or None when off (no collective then). Clears the sum either way."""
        total = torch.as_tensor(self.take(), dtype=torch.float32, device=device)
        return (reduce(total) / global_tokens).item() if self.weight else None


def model_loss(model, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor | float = 1.0,
               *, chunk_tokens: int = 0, z_loss=None, **model_kwargs) -> torch.Tensor:
    """The loss of a whole model (or a pipeline stage with the output head) on one microbatch.

    ``chunk_tokens > 0`` (``[loss] chunk_tokens``): the model fuses its output projection with the
    cross entropy over chunks of that many tokens and returns the token sum itself
    (models/common/linear_cross_entropy.py); no [B, S, V] logits exist. 0: the model returns the logits and
    :func:`token_sum_loss` takes them. A model whose objective needs the labels beyond the next
    token (``model.needs_labels``, e.g. multi-token prediction) gets them either way and returns the
    token sum itself. Either way the result is the token sum / ``global_tokens``.

    Args:
        model: called as ``model(inputs, **model_kwargs)`` or ``model(inputs, labels=...,
            loss_chunk_tokens=..., **model_kwargs)``.
        inputs, labels: LongTensor [B, S]; global_tokens: see :func:`token_sum_loss`.
        model_kwargs: the model's other keyword inputs (document masking's ids and positions).
        z_loss: the unfused loss's :class:`ZLoss` (the fused one reads the model's ``z_loss`` attribute).
    """
    if chunk_tokens > 0 or getattr(model, "needs_labels", False):  # (a default None is as falsy: equivalent)
        token_sum = model(inputs, labels=labels, loss_chunk_tokens=chunk_tokens, **model_kwargs)
        return fused_stage_loss(token_sum, labels, global_tokens)  # (labels unused there: None is equivalent)
    return token_sum_loss(model(inputs, **model_kwargs), labels, global_tokens, z_loss=z_loss)


def fused_stage_loss(token_sum: torch.Tensor, labels: torch.Tensor,
                     global_tokens: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The pipeline's loss function when the last stage already returns the fused token sum:
    ``token_sum / global_tokens`` (``labels`` is the schedule's target, already used by the stage)."""
    return token_sum / global_tokens


def last_stage_loss(context):
    """How the pipeline's last stage turns a microbatch into its loss: ``(takes_labels, loss_fn)``.

    With the fused loss (``context.loss_chunk_tokens > 0``), or an objective that needs the labels
    (``context.window_parts``: parts whose ``needs_labels``, e.g. multi-token prediction), the stage
    returns the token sum itself, given the labels as a model keyword (``takes_labels``; torch's
    schedules split keyword tensors into microbatches like the inputs): ``loss_fn`` is
    :func:`fused_stage_loss`. Else the stage returns the logits and ``loss_fn`` is
    :func:`token_sum_loss` with the run's z-loss (``context.z_loss``). Torch's schedules call
    ``loss_fn(stage output, target, global_tokens=...)``.

    Args:
        context: the run's ``engine.train.runner.StepContext``.
    """
    if context.loss_chunk_tokens > 0 or context.window_parts:
        return True, fused_stage_loss
    return False, functools.partial(token_sum_loss, z_loss=context.z_loss)
