"""Measurement discipline for scripts/benchmark.py: a load guard, interleaved A/B timing, robust stats.

Rules (the brief's: performance claims are ratios measured side by side in one run):
- :func:`other_load` refuses to measure while other processes keep the machine's cores busy;
- :func:`interleave` alternates the variants of a comparison round by round, so that drifts of a
  shared machine (frequency, neighbours) hit all variants alike;
- warm-up steps are dropped and each variant is summarised by its median, with the inter-quartile
  range (p25-p75) as the spread (:class:`Stat`); a comparison is the ratio of two medians, with the
  quartiles of its bootstrap distribution as the spread (:func:`ratio_stat`).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


class MachineBusyError(RuntimeError):
    """Other load on the machine exceeds the threshold: measurements would be contention."""


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (Linux)."""
    with open("/proc/stat") as file:
        fields = [int(v) for v in file.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def other_load(seconds: float = 1.0) -> float:
    """Fraction of all cores busy while this process sleeps for ``seconds`` (0.0-1.0).

    Returns 0.0 where /proc/stat does not exist (not Linux): the guard is then off.
    """
    if not os.path.exists("/proc/stat"):
        return 0.0
    busy0, total0 = _cpu_times()
    time.sleep(seconds)
    busy1, total1 = _cpu_times()
    return (busy1 - busy0) / max(1, total1 - total0)


def guard_load(max_load: float, what: str) -> float:
    """Measure :func:`other_load` and raise :class:`MachineBusyError` above ``max_load``.

    Returns the measured load (recorded with the results)."""
    load = other_load()
    if load > max_load:
        cores = os.cpu_count() or 1
        raise MachineBusyError(
            f"before {what}: {load:.0%} of {cores} cores are busy with other processes (limit "
            f"--max-load {max_load:.2f}); the numbers would measure contention. Stop the other work "
            f"or raise --max-load."
        )
    return load


@dataclass
class Stat:
    """Median and inter-quartile range of samples (seconds, or any unit)."""

    median: float
    p25: float
    p75: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> "Stat":
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)
        if len(ordered) == 1:
            return cls(ordered[0], ordered[0], ordered[0], 1)
        q = statistics.quantiles(ordered, n=4, method="inclusive")
        return cls(statistics.median(ordered), q[0], q[2], len(ordered))

    @property
    def spread(self) -> float:
        """(p75 - p25) / median: the relative spread."""
        return (self.p75 - self.p25) / self.median if self.median else 0.0

    def as_dict(self) -> dict:
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "n": self.n, "spread": self.spread}


def interleave(variants: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Run every variant once per round, in rotating order; collect the samples each call returns.

    Each callable runs one block of measurements (e.g. k steps after its own warm-up) and returns
    its per-step seconds. The order rotates every round so no variant always runs first.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            samples[name] += variants[name]()
    return samples


def ratio_stat(numerator: list[float], denominator: list[float], resamples: int = 2000, seed: int = 0) -> Stat:
    """Ratio of the medians of two sample sets (e.g. per-step seconds), with its bootstrap quartiles.

    ``median`` is median(numerator) / median(denominator); ``p25`` and ``p75`` are the quartiles of
    that same statistic over ``resamples`` bootstrap resamples (each side drawn with replacement,
    independently; Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13, percentile
    interval), so the spread describes the reported ratio itself. A fixed ``seed`` makes the numbers
    reproducible from the samples (``--json`` keeps them). ``n`` is the smaller sample count.

    Raises:
        ValueError: either list is empty.
    """
    if not numerator or not denominator:
        raise ValueError("no samples")
    median = statistics.median(numerator) / statistics.median(denominator)
    rng = random.Random(seed)
    ratios = [statistics.median(rng.choices(numerator, k=len(numerator)))
              / statistics.median(rng.choices(denominator, k=len(denominator))) for _ in range(resamples)]
    spread = Stat.of(ratios)
    return Stat(median, spread.p25, spread.p75, min(len(numerator), len(denominator)))
