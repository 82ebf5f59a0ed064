"""Evaluation between training steps: the validation loss and the ``[eval]`` downstream tasks
(engine/train/downstream.py), each when due, timed as evaluation in the goodput ledger
(engine/observe/goodput.py ``evaluation_s``), never as step time; a service of the loop
(engine/train/services.py)."""

from __future__ import annotations

import math

import torch

from engine.train.services import Service


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


class Evaluation(Service):
    """After each reported step (``after_save``): the validation loss every ``validation.freq`` steps
    and the downstream tasks every ``eval.freq`` steps, both at the loop's last step; each logged
    (metrics.jsonl, TensorBoard, W&B) and timed by ``timing``. :attr:`phase` names the part that
    failed in the one-line error (engine/train/after_step.py).

    Args:
        validation: the ``[validation]`` section (``enable``, ``freq``).
        validate: () -> the validation loss (nats per token), e.g. ``Trainer.validate``.
        downstream: the ``[eval]`` tasks (engine/train/downstream.py ``DownstreamEvaluation``), or None.
        model_parts, device: what the downstream tasks evaluate, and where.
        metrics: the run's ``engine.observe.metrics.MetricsLogger``.
        timing: ``timing(step)``, a context manager around each evaluation (engine/train/recovery.py
            ``RunRecovery.evaluating``).
    """

    phase = "validation"

    def __init__(self, validation, validate, downstream, *, model_parts, device, metrics, timing):
        self.validation, self.validate, self.downstream = validation, validate, downstream
        self.model_parts, self.device, self.metrics, self.timing = model_parts, device, metrics, timing
        self.last = 0

    def on_start(self, step: int, last: int) -> None:
        self.last = last

    def after_save(self, record: dict) -> None:
        step, v = record["step"], self.validation
        if v.enable and (step % v.freq == 0 or step == self.last):
            self.phase = "validation"
            with self.timing(step):
                val_loss = self.validate()
            self.phase = "metrics"
            self.metrics.log_validation(step, val_loss, math.exp(min(val_loss, 50.0)))
        if self.downstream is not None and self.downstream.due(step, self.last):
            self.phase = "downstream evaluation"
            with self.timing(step):
                results, _ = self.downstream.evaluate(self.model_parts, self.device)
            self.phase = "metrics"
            self.metrics.log_eval(step, results)
