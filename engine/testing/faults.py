"""Faults injected into a Trainer's steps without touching the engine's code (the step-health tests,
tests/unit/test_step_health.py, and scripts/benchmarks/step_health_cost.py): make step k's gradient
non-finite or its loss / gradient norm spike.

The hook wraps ``trainer.runner.step`` (forward and backward of the step's microbatches, before the
gradient norm and the update): ``nan_grad`` writes NaN into the first element of this rank's first
local gradient, ``grad_spike`` multiplies every local gradient by 100 (the global norm by 100 on every
layout), ``loss_spike`` multiplies this rank's share of the loss by 10 (the global loss by 10).
"""

from __future__ import annotations

import torch

KINDS = ("nan_grad", "grad_spike", "loss_spike")


def _local_grads(trainer) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for part in trainer.model_parts for p in part.parameters() if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def inject(trainer, plan: dict[int, str]) -> None:
    """Apply ``plan`` ({1-based step: kind of :data:`KINDS`}) to ``trainer``'s coming steps."""
    original = trainer.runner.step

    def step(microbatches, global_tokens):
        loss = original(microbatches, global_tokens)
        kind = plan.get(trainer.step + 1)
        if kind == "nan_grad":
            grad = _local_grads(trainer)[0]
            grad[(0,) * grad.ndim] = float("nan")
        elif kind == "grad_spike":
            for grad in _local_grads(trainer):
                grad.mul_(100.0)
        elif kind == "loss_spike":
            loss = loss * 10.0
        elif kind is not None:
            raise ValueError(f"unknown injection {kind!r}; use one of {KINDS}")
        return loss

    trainer.runner.step = step
