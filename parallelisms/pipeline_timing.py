"""Measured pipeline bubble: the fraction of a step in which a rank does no stage compute.

Each of this rank's pipeline stages gets its forward and backward chunk methods wrapped with a
timer; per step, busy = Σ chunk seconds and bubble = 1 - busy / step seconds. For GPipe with equal
stages this approaches (K-1)/(M+K-1) (K stages, M microbatches; GPipe, Huang et al. arXiv 1811.06965).
On CUDA, chunk times come from CUDA events read once after the step, so timing adds no
synchronization per chunk.
"""

from __future__ import annotations

import functools
import time

import torch

_TIMED_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StageBusyTimer:
    """Accumulates the compute time (seconds) of pipeline stage chunks between ``reset`` calls."""

    def __init__(self, stages, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for stage in stages:
            for name in _TIMED_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return method(*args, **kwargs)
                finally:
                    end.record()
                    self._events.append((start, end))
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._cpu_seconds += time.perf_counter() - start

        return wrapper

    def reset(self) -> None:
        self._cpu_seconds = 0.0
        self._events.clear()

    def busy_seconds(self) -> float:
        """Compute seconds since the last reset (synchronizes CUDA once to read the events)."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
        return self._cpu_seconds


def gpipe_bubble_fraction(num_stages: int, n_microbatches: int) -> float:
    """Idle fraction of GPipe with K equal stages and M microbatches: (K-1)/(M+K-1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)
