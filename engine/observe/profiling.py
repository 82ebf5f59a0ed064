"""``[profiling]``: torch.profiler traces of chosen steps, and CUDA memory snapshots.

Traces: steps ``start_step .. start_step + num_steps - 1`` run under ``torch.profiler.profile`` (CPU
ops, and CUDA kernels on a GPU), and each rank writes one Chrome-trace JSON file,
``<run folder>/<traces_folder>/rank<r>_step<a>-<b>.json``, which Perfetto (https://ui.perfetto.dev)
and ``chrome://tracing`` open (torch docs, "PyTorch Profiler": ``export_chrome_trace``).

Memory snapshots (CUDA only): with ``memory_snapshot = true`` the caching allocator records every
allocation with its stack from the start of training (``torch.cuda.memory._record_memory_history``),
and ``<run folder>/<traces_folder>/rank<r>_memory_step<n>.pickle`` is dumped after the traced steps and
when a step runs out of memory (torch docs, "Understanding CUDA Memory Usage"; open at
https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("quadra")


class StepProfiler:
    """Starts and stops the profiler around the configured steps; dumps memory snapshots.

    Args:
        cfg: the ``[profiling]`` section (``enable``, ``start_step``, ``num_steps``, ``traces_folder``,
            ``memory_snapshot``).
        run_folder: the run's dump folder; rank: global rank (file names); device: the training device.
    """

    def __init__(self, cfg, run_folder: str, rank: int, device: torch.device):
        self.cfg = cfg
        self.folder = os.path.join(run_folder, cfg.traces_folder)
        self.rank = rank
        self.device = device
        self.last_step = cfg.start_step + cfg.num_steps - 1
        self._profile: torch.profiler.profile | None = None
        self._stopped: torch.profiler.profile | None = None  # stopped, not yet written
        self.snapshots = cfg.memory_snapshot and device.type == "cuda"
        if cfg.memory_snapshot and not self.snapshots:
            logger.warning("profiling.memory_snapshot = true needs a CUDA device; no snapshot on %s", device.type)
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step_begin(self, step: int) -> None:
        """Call before 1-based ``step`` runs."""
        if self.cfg.enable and step == self.cfg.start_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profile.__enter__()

    def step_end(self, step: int) -> None:
        """Call right after 1-based ``step`` trained: stops tracing after the last traced step (what
        follows the step, such as a checkpoint save, stays out of the trace); :meth:`write` writes it."""
        if self._profile is not None and step == self.last_step:
            self._profile.__exit__(None, None, None)
            self._stopped, self._profile = self._profile, None

    def write(self, step: int) -> None:
        """Write the trace stopped by :meth:`step_end` (and the memory snapshot), if any. Called after
        the step's checkpoint, since writing files can fail (a full disk) and must not lose the step."""
        if self._stopped is None:
            return
        profile, self._stopped = self._stopped, None
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{self.rank}_step{self.cfg.start_step}-{self.last_step}.json")
        profile.export_chrome_trace(path)
        logger.info("profiler trace of steps %d-%d: %s", self.cfg.start_step, self.last_step, path)
        self.dump_memory_snapshot(step)

    def dump_memory_snapshot(self, step: int) -> str | None:
        """Write the recorded CUDA allocations (after the traced steps, or on out-of-memory); the path
        or None when snapshots are off."""
        if not self.snapshots:
            return None
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{self.rank}_memory_step{step}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.warning("CUDA memory snapshot: %s (open at https://pytorch.org/memory_viz)", path)
        return path

    def close(self) -> None:
        """Stop a trace still running (training ended inside the traced steps) and the recording."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
