"""The step-health tests' helpers around the fault hook of engine/testing/faults.py: a state snapshot,
bitwise differences, and a run with faults injected at chosen steps."""

from __future__ import annotations

import torch

from engine.testing.faults import inject


def state_snapshot(trainer) -> dict[str, torch.Tensor]:
    """Clones of this rank's parameters, model buffers and optimizer state (moments and step count),
    as local tensors: what a skipped step must leave bitwise unchanged."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for i, part in enumerate(trainer.model_parts):
        out.update({f"{i}.param.{name}": local(p) for name, p in part.named_parameters()})
        out.update({f"{i}.buffer.{name}": local(b) for name, b in part.named_buffers() if b is not None})
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    for j, param in enumerate(params):
        state = trainer.optimizer.state.get(param, {})
        out.update({f"optim.{j}.{key}": local(value) for key, value in state.items() if torch.is_tensor(value)})
    return out


def bitwise_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (NaN compares equal to itself), or exist on one side only."""
    def bits(t):
        return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t

    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].shape != b[n].shape
            or a[n].dtype != b[n].dtype or not torch.equal(bits(a[n]), bits(b[n]))]


def train_injected(argv: list[str], plan: dict[int, str], steps: int | None = None) -> dict:
    """Build a Trainer from CLI-style ``argv``, inject ``plan``, train; returns ``{"history":
    [(step, loss, grad_norm, skipped reason)], "skipped": summary, "state": step_health state,
    "error": the TrainingDivergedError message or None}`` (every rank)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer, TrainingDivergedError

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    inject(trainer, plan)
    error = None
    try:
        trainer.train(steps)
    except TrainingDivergedError as diverged:
        error = str(diverged)
    finally:
        trainer.close(wait=error is None)
    history = [(h["step"], h["loss"], h["grad_norm"], h["skipped"]) for h in trainer.history]
    return {"history": history, "skipped": trainer.step_health.summary(), "state": trainer.step_health.state_dict(),
            "error": error, "step": trainer.step}
