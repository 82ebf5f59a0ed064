"""Pipeline bubble of a schedule: the idle fraction of a step with equal stage times.

- GPipe (Huang et al. arXiv 1811.06965) and 1F1B (PipeDream-Flush, Narayanan et al. arXiv
  2006.09503): K pipeline ranks, M microbatches, bubble = (K-1)/(M+K-1) of the step (the schedule's
  own timetable: M + K - 1 slots of forward+backward, K - 1 of them idle on every rank).
- Interleaved 1F1B / LoopedBFS (Narayanan et al. arXiv 2104.04473 §2.2): v stages per rank shrink the
  warm-up by v: bubble time (K-1)/v slots of a whole-rank microbatch, fraction (K-1)/(v·M + K-1).
- Interleaved zero bubble (ZB-H1 analogue, Qi et al. arXiv 2401.10241 §3): splitting backward into
  input and weight gradients fills a third of 1F1B's bubble with weight gradients: (K-1)/3 idle slots,
  fraction (K-1)/(3·v·M + K-1) with v = 2.
- ZBVZeroBubble and DualPipeV (V-shaped, Qi et al. §5 "ZB-V"; DeepSeek-V3 arXiv 2412.19437 §3.2.1):
  zero bubble when M >= 2K (the paper's condition), else the 1F1B-V warm-up (K-1)/(v·M + K-1).
Times of forward, input-gradient and weight-gradient passes are taken equal (the papers' F = B = W
simplification), so these are the papers' idealized figures.
"""

from __future__ import annotations


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step (0 without pipeline parallel).

    Args:
        schedule: a torch.distributed.pipelining name (case-insensitive); pp: K ranks;
        n_microbatches: M per schedule step; stages_per_rank: v.

    Raises:
        ValueError: an unknown schedule, or pp / n_microbatches < 1.
    """
    if pp < 1 or n_microbatches < 1:
        raise ValueError(f"pp = {pp} and n_microbatches = {n_microbatches} must be >= 1")
    if pp == 1:
        return 0.0
    k, m, v = pp, n_microbatches, max(stages_per_rank, 1)
    name = schedule.lower()
    if name in ("gpipe", "1f1b"):
        return (k - 1) / (m + k - 1)
    if name in ("interleaved1f1b", "loopedbfs"):
        return (k - 1) / (v * m + k - 1)
    if name == "interleavedzerobubble":
        return (k - 1) / (3 * v * m + k - 1)
    if name in ("zbvzerobubble", "dualpipev"):
        return 0.0 if m >= 2 * k else (k - 1) / (v * m + k - 1)
    raise ValueError(f"parallelism.pp_schedule = {schedule!r} has no bubble model; "
                     "use a torch.distributed.pipelining name")


def layout_bubble(layout) -> float:
    """:func:`bubble_fraction` of a resolved layout (engine/planner/layout.py)."""
    if layout.pp == 1:
        return 0.0
    plan = layout.pp_plans[0]
    return bubble_fraction(plan.schedule_name, layout.pp, plan.n_microbatches, len(plan.local_stages))
