"""Comparison of a run with the one-process reference: relative differences and the tolerances of
each precision (torch-free).

Tolerances (relative): float32 1e-5 at step 1 and 1e-4 at every later step, the suite's standard
(tests/training_utils.py); float64 1e-12 at every step. A layout computes the same sums in another
order, so float32 agrees to a few ulps (about 1e-7) at step 1; Adam then amplifies the difference
step by step. Parameters are compared tensor by tensor as ``max|a - b| / max|b|`` (the norm-wise
relative error in the max norm, Higham, "Accuracy and Stability of Numerical Algorithms", 2002,
§6.1), against the tolerance of the last step.
"""

from __future__ import annotations

import math

TOLERANCES = {"float32": (1e-5, 1e-4), "float64": (1e-12, 1e-12)}
# A clipped step must be this far above max_norm (and an unclipped one below it) to count: a norm
# near the threshold tells little about a wrong clip.
CLIP_MARGIN = 0.1


def tolerance(step: int, precision: str = "float32") -> float:
    """Relative tolerance of ``step`` (1-based) at ``precision`` ("float32" or "float64")."""
    first, later = TOLERANCES[precision]
    return first if step == 1 else later


def relative_difference(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (inf when only one is non-finite, 0 when both are equal)."""
    if value == reference:
        return 0.0
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / abs(reference) if reference else math.inf


def history_differences(got: list[tuple[float, float]], want: list[tuple[float, float]],
                        precision: str = "float32", tolerances: list[float] | None = None) -> dict:
    """Worst relative difference of loss and grad norm over the steps, and the first failing step.

    Args:
        got, want: [(loss, grad_norm)] per step, 1-based order; a missing step counts as failing.
        precision: whose :data:`TOLERANCES` apply; tolerances: per-step relative tolerances instead
            (a measured noise floor's, engine/parity/noise.py), one per step of ``want``.

    Returns:
        {"loss": worst, "grad_norm": worst, "loss_step": its step, "grad_norm_step": its step,
         "first_failing_step": step or None, "passed": bool}
    """
    out = {"loss": 0.0, "grad_norm": 0.0, "loss_step": None, "grad_norm_step": None, "first_failing_step": None}
    failing = [] if len(got) == len(want) else [min(len(got), len(want)) + 1]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), start=1):
        for key, value, ref in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
            diff = relative_difference(value, ref)
            if out[f"{key}_step"] is None or diff > out[key]:
                out[key], out[f"{key}_step"] = diff, step
            if diff > (tolerance(step, precision) if tolerances is None else tolerances[step - 1]):
                failing.append(step)
    out["first_failing_step"] = min(failing) if failing else None
    out["passed"] = out["first_failing_step"] is None
    return out


def tensor_difference(a, b) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / max |b|) of two tensors of one shape (relative: 0 when both are
    zero, inf when only ``a`` is not)."""
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0  # empty: diff is 0, so any scale gives 0 (equivalent mutants)
    return diff, (diff / scale if scale else (0.0 if diff == 0 else math.inf))


def parameter_differences(got: dict, want: dict) -> tuple[float, str | None, list[str]]:
    """(worst ``max|a - b| / max|b|`` over the tensors, its name, names present on one side only).

    Args:
        got, want: {name: tensor} (full, unsharded: e.g. a checkpoint's weights).
    """
    worst, worst_name = 0.0, None
    missing = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name].double(), want[name].double()
        if a.shape != b.shape:
            missing.append(f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})")
            continue
        _, rel = tensor_difference(a, b)
        if rel > worst or worst_name is None:
            worst, worst_name = max(rel, worst), name
    return worst, worst_name, missing


def clipping_sides(history: list[tuple[float, float]], max_norm: float) -> tuple[int, int]:
    """(steps clipped, steps not clipped) of a history, counting only norms at least
    :data:`CLIP_MARGIN` away from ``max_norm`` (a step near it tells a wrong clip little)."""
    if max_norm <= 0:
        return 0, len(history)
    above = sum(norm > max_norm * (1 + CLIP_MARGIN) for _, norm in history)
    below = sum(norm < max_norm * (1 - CLIP_MARGIN) for _, norm in history)
    return above, below


def engaging_max_norm(history: list[tuple[float, float]]) -> float:
    """A ``training.max_norm`` that clips some steps of ``history`` and not others where the norms
    spread enough (the geometric mean of the smallest and largest norm), else 0.8 × the smallest norm
    (clips every step), rounded to 3 significant digits."""
    norms = sorted(norm for _, norm in history if math.isfinite(norm) and norm > 0)
    if not norms:
        return 1.0
    lo, hi = norms[0], norms[-1]
    value = math.sqrt(lo * hi) if hi > lo * (1 + CLIP_MARGIN) ** 2 * 1.02 else 0.8 * lo
    return float(f"{value:.3g}")
