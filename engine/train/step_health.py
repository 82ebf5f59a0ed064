"""Step health: decide, before the update, whether a step's loss and gradient norm are fit to apply.

A step is judged on two numbers every rank already holds after the step's reductions: the global
mean token loss (summed over data, context and pipeline ranks by the trainer) and the global gradient
norm before clipping (all-reduced by ``parallelisms.grad_norm.clip_grad_norm_``). Both are read to the
host once per step, as the loop always did for logging; the judgement is then plain Python float64
arithmetic on identical inputs, so every rank of every layout takes the same decision without
exchanging it.

Rules, in order (``[step_health]``, engine/config/schema.py):

1. A non-finite loss or gradient norm: ``on_nonfinite = "stop"`` ends the run (raised on every rank,
   no update applied), ``"skip"`` withholds the update.
2. A spike: with ``loss_spike_sigma`` = k > 0, the step is skipped when
   ``loss - mean > k * std`` over the last ``window`` *accepted* steps (sample standard deviation);
   likewise ``grad_norm_spike_sigma`` for the gradient norm. The check starts once the window holds
   ``max(2, window // 2)`` steps. This is OLMo-core's rule (``SkipStepOptimizer``: rolling window of
   recent losses and gradient norms, skip above ``sigma_factor`` standard deviations; Groeneveld et
   al. 2024, arXiv 2402.00838 and OLMo 2, arXiv 2501.00656), taken on the host because the host
   already waits for these two numbers every step.
3. ``max_consecutive_skips`` = N > 0 skipped steps in a row stop the run.

Skipped steps do not enter the window, so a burst of spikes cannot raise the bar for the next ones.
The state (window, counters) is part of the trainer's checkpoint, so a resumed run takes every later
decision bitwise as the uninterrupted one would.
"""

from __future__ import annotations

import collections
import json
import math
import warnings
from dataclasses import dataclass, field


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf, or step_health.max_consecutive_skips steps in a row were skipped;
    raised on every rank at the same step (``Trainer.train_step``)."""


def advance_lr_schedule(lr_scheduler) -> None:
    """``lr_scheduler.step()`` for a skipped step: the schedule advances as if the update had been
    applied. Torch warns when a scheduler steps before the optimizer ever did (a skipped first step);
    here that order is intended, so that one warning is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        lr_scheduler.step()


NONFINITE_LOSS, NONFINITE_GRAD_NORM = "nonfinite_loss", "nonfinite_grad_norm"
LOSS_SPIKE, GRAD_NORM_SPIKE = "loss_spike", "grad_norm_spike"


@dataclass
class Verdict:
    """The decision on one step.

    Attributes:
        step: 1-based optimizer step judged.
        loss, grad_norm: the step's global loss (nats per token) and gradient norm before clipping.
        reason: None (a healthy step) or one of ``nonfinite_loss``, ``nonfinite_grad_norm``,
            ``loss_spike``, ``grad_norm_spike``.
        value: the judged value (the loss or the gradient norm), None for a healthy step.
        zscore: (value - window mean) / window std; inf when std is 0, None without statistics.
        skip: the update is withheld (also on a fatal step: no update reaches the weights).
        fatal: one line saying why the run stops here, or None.
        statistics: for a skipped or fatal step, the window's count, mean and std of loss and
            gradient norm before this step, and the consecutive and total skips after it; else {}.
    """

    step: int
    loss: float
    grad_norm: float
    reason: str | None = None
    value: float | None = None
    zscore: float | None = None
    skip: bool = False
    fatal: str | None = None
    statistics: dict = field(default_factory=dict)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1), summed exactly (``math.fsum``): the same floats on
    every rank for the same values."""
    mean = math.fsum(values) / len(values)
    # d * d, not d ** 2: a huge finite loss then gives inf instead of raising OverflowError.
    return mean, math.sqrt(math.fsum((v - mean) * (v - mean) for v in values) / (len(values) - 1))


class StepHealth:
    """The rules of the module docstring over a window of accepted steps.

    Args:
        cfg: the ``[step_health]`` section (on_nonfinite, loss_spike_sigma, grad_norm_spike_sigma,
            window, max_consecutive_skips), validated by engine/config/validation.py.
        clipping: whether gradients are clipped (``training.max_norm > 0``); named in the stop line.

    Attributes: ``skipped`` (steps skipped so far in the run, resumes included), ``consecutive``
    (skipped in a row up to the last judged step), ``skipped_by_reason`` ({reason: count}).
    """

    def __init__(self, cfg, *, clipping: bool = True):
        self.cfg = cfg
        self.clipping = clipping  # training.max_norm > 0: else the stop line suggests clipping
        self.window: collections.deque[tuple[float, float]] = collections.deque(maxlen=cfg.window)
        self.skipped = 0
        self.consecutive = 0
        self.first_consecutive = 0  # the first step of the current run of skips
        self.skipped_by_reason: dict[str, int] = {}

    @property
    def min_samples(self) -> int:
        """Accepted steps the window needs before spikes are judged."""
        return max(2, self.cfg.window // 2)

    def statistics(self) -> dict:
        """{count, loss_mean, loss_std, grad_norm_mean, grad_norm_std} of the window (None below 2 steps)."""
        stats: dict = {"count": len(self.window)}
        for i, name in enumerate(("loss", "grad_norm")):
            mean, std = _mean_std([w[i] for w in self.window]) if len(self.window) >= 2 else (None, None)
            stats[f"{name}_mean"], stats[f"{name}_std"] = mean, std
        return stats

    def judge(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """Judge step ``step`` and record it (window or skip counters); see the module docstring.

        The window statistics (O(window) exact sums) are computed only when a spike check is on and
        the window is half full, or for an unhealthy step's capsule: with the defaults a healthy
        step costs a deque append."""
        verdict = Verdict(step, loss, grad_norm)
        stats = None
        checks = self.cfg.loss_spike_sigma > 0 or self.cfg.grad_norm_spike_sigma > 0
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            verdict.reason = NONFINITE_LOSS if not math.isfinite(loss) else NONFINITE_GRAD_NORM
            verdict.value = loss if verdict.reason == NONFINITE_LOSS else grad_norm
            verdict.skip = True
            if self.cfg.on_nonfinite == "stop":
                verdict.fatal = (f"loss is {loss} (grad_norm {grad_norm}) at step {step}: training diverged; no "
                                 "update was applied. Lower optimizer.lr or raise lr_scheduler.warmup_steps"
                                 f"{'' if self.clipping else ', set training.max_norm to clip gradients'}, or set "
                                 'step_health.on_nonfinite = "skip" to skip such steps')
        elif checks and len(self.window) >= self.min_samples:
            stats = self.statistics()
            checked = ((LOSS_SPIKE, loss, self.cfg.loss_spike_sigma, "loss"),
                       (GRAD_NORM_SPIKE, grad_norm, self.cfg.grad_norm_spike_sigma, "grad_norm"))
            for reason, value, sigma, name in checked:
                mean, std = stats[f"{name}_mean"], stats[f"{name}_std"]
                if sigma > 0 and value - mean > sigma * std:
                    verdict.reason, verdict.value, verdict.skip = reason, value, True
                    verdict.zscore = (value - mean) / std if std > 0 else math.inf
                    break
        if verdict.skip:
            stats = stats or self.statistics()  # the window before this step (a skip never enters it)
            self._count_skip(verdict)
            verdict.statistics = {**stats, "consecutive_skips": self.consecutive, "skipped_total": self.skipped}
        else:
            self.window.append((loss, grad_norm))
            self.consecutive = 0
        return verdict

    def _count_skip(self, verdict: Verdict) -> None:
        if self.consecutive == 0:
            self.first_consecutive = verdict.step
        self.consecutive += 1
        self.skipped += 1
        self.skipped_by_reason[verdict.reason] = self.skipped_by_reason.get(verdict.reason, 0) + 1
        limit = self.cfg.max_consecutive_skips
        if verdict.fatal is None and limit > 0 and self.consecutive >= limit:
            z = "" if verdict.zscore is None else f", z-score {verdict.zscore:.2f}"
            verdict.fatal = (f"step_health.max_consecutive_skips = {limit} reached: steps {self.first_consecutive}-"
                             f"{verdict.step} were all skipped (last: {verdict.reason}, value {verdict.value}{z}); "
                             "training stopped. Lower optimizer.lr, raise the spike thresholds or "
                             "step_health.max_consecutive_skips")

    def summary(self) -> str:
        """``N steps skipped (loss_spike 2, nonfinite_grad_norm 1)``, or ``no step skipped``."""
        if not self.skipped:
            return "no step skipped"
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.skipped_by_reason.items()))
        return f"{self.skipped} step{'s' if self.skipped != 1 else ''} skipped ({reasons})"

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> str:
        """The state as one JSON string (floats written by ``repr``, which round-trips them exactly;
        one string is one DCP byte item, whatever the window holds)."""
        return json.dumps({"window": [list(w) for w in self.window], "skipped": self.skipped,
                           "consecutive": self.consecutive, "first_consecutive": self.first_consecutive,
                           "skipped_by_reason": self.skipped_by_reason})

    def load_state_dict(self, state: str) -> None:
        """Restore :meth:`state_dict`; a shorter ``window`` setting keeps the newest steps."""
        saved = json.loads(state)
        self.window.clear()
        self.window.extend((float(loss), float(norm)) for loss, norm in saved["window"])
        self.skipped, self.consecutive = int(saved["skipped"]), int(saved["consecutive"])
        self.first_consecutive = int(saved["first_consecutive"])
        self.skipped_by_reason = {k: int(v) for k, v in saved["skipped_by_reason"].items()}
