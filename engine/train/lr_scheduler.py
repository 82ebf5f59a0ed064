"""Learning-rate schedule: linear warmup, then constant / linear / cosine / WSD decay.

The schedule is a function of the 1-based optimizer step ``s`` (step 1 is the first
``optimizer.step()`` of the run), with W = ``warmup_steps`` and T = ``training_steps``:

* warmup, 1 <= s <= W:   lr(s) = lr * s / W  (step 1 uses lr/W, step W uses exactly lr)
* after warmup, W < s <= T, with a decay progress p in (0, 1]:
    - constant: lr(s) = lr
    - linear:   lr(s) = lr + (min_lr - lr) * p,                 p = (s - W) / (T - W)
    - cosine:   lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2   (Loshchilov & Hutter 2017,
                SGDR, one half period, no restarts), same p as linear
    - wsd:      warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): lr until step
                T - D, then linear to min_lr, p = (s - (T - D)) / D, where
                D = round(decay_ratio * T) decay steps (at least 1 when decay_ratio > 0)
* s > T: the value at T (so a ``scheduler.step()`` after the final optimizer step is harmless).

The curve is continuous and piecewise: it rises from 0 at s=0 to lr at s=W and falls to min_lr at
s=T, so the last step of every decaying schedule uses exactly ``min_lr``. Unlike TorchTitan's
``s / (W + 1)`` warmup, warmup here ends *at* lr; with W=0 the first step is already on the decay
curve (linear: lr * (1 - 1/T) for min_lr=0).
"""

from __future__ import annotations

import functools
import math

from engine.config.validation import effective_warmup_steps, wsd_decay_steps  # the warmup the config decides

SUPPORTED_DECAY_TYPES = ("constant", "linear", "cosine", "wsd")


def _check_schedule(
    *, warmup_steps: int, decay_type: str, decay_ratio: float, training_steps: int, lr: float,
    min_lr: float,
) -> None:
    """Raise ValueError naming the offending setting; see ``lr_factor`` for the rules."""
    if decay_type not in SUPPORTED_DECAY_TYPES:
        raise ValueError(
            f"lr_scheduler.decay_type={decay_type!r} is not supported; "
            f"use one of {list(SUPPORTED_DECAY_TYPES)}"
        )
    if training_steps < 1:
        raise ValueError(f"training.steps={training_steps} must be >= 1")
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps={warmup_steps} must be >= 0")
    if warmup_steps > training_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps={warmup_steps} must be <= training.steps={training_steps}; "
            "lower lr_scheduler.warmup_steps or raise training.steps (build_lr_scheduler clamps it)"
        )
    if not lr > 0:
        raise ValueError(f"optimizer.lr={lr} must be > 0")
    if not 0 <= min_lr <= lr:
        raise ValueError(
            f"lr_scheduler.min_lr={min_lr} must be in [0, optimizer.lr={lr}]"
        )
    if not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.decay_ratio={decay_ratio} must be in [0, 1]")
    if decay_type == "wsd":
        decay_steps = wsd_decay_steps(decay_ratio, training_steps)
        if warmup_steps + decay_steps > training_steps:
            raise ValueError(
                f"lr_scheduler.warmup_steps={warmup_steps} plus the wsd decay of "
                f"round(lr_scheduler.decay_ratio={decay_ratio} * training.steps={training_steps})"
                f"={decay_steps} steps exceeds training.steps; lower one of them"
            )


def lr_factor(
    step: int, *, warmup_steps: int, decay_type: str, decay_ratio: float, training_steps: int,
    lr: float, min_lr: float,
) -> float:
    """Multiplier of the base ``lr`` for 1-based optimizer step ``step`` (pure function).

    Args:
        step: 1-based index of the optimizer step being taken (>= 1; steps past
            ``training_steps`` get the final value).
        warmup_steps: W, linear warmup length in optimizer steps (0 <= W <= training_steps; with
            W = T the whole run is warmup and the last step uses exactly lr).
        decay_type: constant | linear | cosine | wsd.
        decay_ratio: wsd only, fraction of ``training_steps`` spent in the final decay, in [0, 1].
        training_steps: T, total optimizer steps of the run.
        lr: peak learning rate (> 0); only used to turn ``min_lr`` into a ratio.
        min_lr: learning rate at step T for decaying schedules, in [0, lr].

    Returns:
        lr(step) / lr, in [0, 1]; the formulas are in the module docstring.

    Raises:
        ValueError: ``step < 1`` or any setting out of range (message names the setting).
    """
    _check_schedule(
        warmup_steps=warmup_steps, decay_type=decay_type, decay_ratio=decay_ratio,
        training_steps=training_steps, lr=lr, min_lr=min_lr,
    )
    if step < 1:
        raise ValueError(f"lr_factor step={step} must be >= 1 (optimizer steps are 1-based)")
    # Past the end (the scheduler.step() after the last optimizer step, or a run extended on
    # resume) the schedule stays at its final value rather than extrapolating below min_lr.
    step = min(step, training_steps)
    if step <= warmup_steps:
        return step / warmup_steps
    if decay_type == "constant":
        return 1.0

    min_factor = min_lr / lr
    if decay_type == "wsd":
        decay_start = training_steps - wsd_decay_steps(decay_ratio, training_steps)
        if step <= decay_start:
            return 1.0
        progress = (step - decay_start) / (training_steps - decay_start)
    else:
        progress = (step - warmup_steps) / (training_steps - warmup_steps)

    if decay_type == "cosine":
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # linear and the decay phase of wsd
    return 1.0 + (min_factor - 1.0) * progress


def _lambda_for_epoch(epoch: int, **schedule) -> float:
    """LambdaLR hook: after ``epoch`` scheduler steps the next optimizer step is ``epoch + 1``."""
    return lr_factor(epoch + 1, **schedule)


def build_lr_scheduler(
    optimizer: "torch.optim.Optimizer", cfg, training_steps: int
) -> "torch.optim.lr_scheduler.LambdaLR":
    """Wrap ``optimizer`` in a LambdaLR following ``lr_factor``.

    Usage (one scheduler step per optimizer step, as in any training loop)::

        for s in range(1, training_steps + 1):
            ...backward...
            optimizer.step()      # uses lr * lr_factor(s)
            scheduler.step()      # prepares lr * lr_factor(s + 1)

    Construction already sets the lr of step 1. The peak lr is the optimizer's current lr
    (``optimizer.lr`` as built by ``build_optimizer``); every param group must share it, over its
    ``lr_mult`` and ``lr_scale`` (a rule's group peaks at ``lr_mult`` x it, a Muon group at
    ``lr_scale`` = optimizer.muon_lr / optimizer.lr x it; ``min_lr`` scales alike).
    The lambda is a ``functools.partial`` of a module-level function, so ``state_dict()`` holds
    only ``last_epoch`` and friends and is picklable; the schedule itself comes from the config
    on resume (changing it between runs takes effect).

    Args:
        optimizer: built optimizer; each group's ``lr`` (or ``initial_lr`` if present) is the peak.
        cfg: the ``[lr_scheduler]`` section; reads ``warmup_steps`` (clamped to the run by
            :func:`effective_warmup_steps`), ``decay_type``, ``decay_ratio`` and ``min_lr``.
        training_steps: ``training.steps``, total optimizer steps.

    Raises:
        ValueError: settings out of range (see ``lr_factor``), or param groups with different lrs.
    """
    import torch

    # A scheduler built before (or a loaded optimizer state) leaves the peak in "initial_lr";
    # "lr" may already be scaled by the schedule then.
    # A group of an optimizer.param_groups rule peaks at lr_mult x the run's lr (its "lr_mult").
    # A Muon group peaks at optimizer.muon_lr = lr_scale x the run's lr (engine/train/optimizer.py).
    peaks = [group.get("initial_lr", group["lr"]) / group.get("lr_mult", 1.0) / group.get("lr_scale", 1.0)
             for group in optimizer.param_groups]
    if any(not math.isclose(peak, peaks[0], rel_tol=1e-12) for peak in peaks):
        raise ValueError(
            f"build_lr_scheduler needs one peak lr shared by all param groups (over their lr_mult and lr_scale), "
            f"got {sorted(peaks)}"
        )
    # optimizer.lr exactly where a group has it unscaled (muon_lr / lr_scale may differ in the last bit)
    base_lrs = {next((peak for peak, group in zip(peaks, optimizer.param_groups) if "lr_scale" not in group), peaks[0])}
    warmup = effective_warmup_steps(cfg.warmup_steps, cfg.decay_type, cfg.decay_ratio, training_steps)
    schedule = dict(
        warmup_steps=warmup, decay_type=cfg.decay_type, decay_ratio=cfg.decay_ratio,
        training_steps=training_steps, lr=base_lrs.pop(), min_lr=cfg.min_lr,
    )
    _check_schedule(**schedule)  # fail here with a config error rather than inside LambdaLR
    # partial, not a closure: its (empty) __dict__ is what LambdaLR.state_dict() stores, so the
    # checkpoint stays picklable and does not freeze the old schedule's settings.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=functools.partial(_lambda_for_epoch, **schedule)
    )
