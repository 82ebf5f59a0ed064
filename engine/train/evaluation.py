"""Evaluation between training steps: the validation loss and the ``[eval]`` downstream tasks
(engine/train/downstream.py), each when due, timed as evaluation in the goodput ledger
(engine/observe/goodput.py ``evaluation_s``), never as step time."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def validation_loss(runner, loader, model_parts, local_batch_size: int, device, reduce) -> float:
    """Mean token loss (nats) over the batches of ``loader`` (each rank's share of a global batch),
    evaluated in batches of ``local_batch_size`` sequences through ``runner.evaluate``; ``reduce``
    sums the [loss sum, label tokens] pair over dp × cp and the pipeline stages, in place."""
    for part in model_parts:
        part.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)  # [loss sum, label tokens]
    for rank_inputs, rank_labels in loader:
        for inputs, labels in zip(rank_inputs.split(local_batch_size), rank_labels.split(local_batch_size)):
            loss, tokens = runner.evaluate(*runner.context.shard(inputs, labels))
            totals[0] += loss
            totals[1] += tokens
    for part in model_parts:
        part.train()
    reduce(totals)
    return float(totals[0] / totals[1].clamp_min(1))


def evaluate_when_due(trainer, last: int) -> None:
    """After step ``trainer.step`` (``last``: the loop's final step): the validation loss every
    ``validation.freq`` steps and the downstream tasks every ``eval.freq`` steps, both at ``last``;
    each logged (metrics.jsonl, TensorBoard, W&B). Sets ``trainer._after_step_phase`` for the
    one-line error of a failure (engine/train/after_step.py)."""
    step, v = trainer.step, trainer.cfg.validation
    if v.enable and (step % v.freq == 0 or step == last):
        trainer._after_step_phase = "validation"
        with trainer.recovery.evaluating():
            val_loss = trainer.validate()
        trainer._after_step_phase = "metrics"
        trainer.metrics.log_validation(step, val_loss, math.exp(min(val_loss, 50.0)))
    if trainer.downstream is not None and trainer.downstream.due(step, last):
        trainer._after_step_phase = "downstream evaluation"
        with trainer.recovery.evaluating():
            results, _ = trainer.downstream.evaluate(trainer.model_parts, trainer.device)
        trainer._after_step_phase = "metrics"
        trainer.metrics.log_eval(step, results)
