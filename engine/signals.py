"""Graceful stop on SIGTERM / SIGUSR1: every rank finishes the current step, then all stop together.

A scheduler that preempts a job (SLURM sends SIGUSR1 or SIGTERM ahead of the kill; torchrun forwards
SIGTERM, and SIGUSR1 when listed in ``TORCHELASTIC_SIGNALS_TO_HANDLE``) may reach the ranks at
different moments, or only some of them. The handler only records the signal; after each step the
trainer calls :meth:`StopRequest.agreed`, an all-reduce (MAX) of the recorded signal number, so all
ranks see the same answer at the same step and can save one checkpoint together before exiting.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger("quadra")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records SIGTERM/SIGUSR1 in this process; :meth:`agreed` turns it into a decision of all ranks.

    Handlers can only be installed from the main thread; elsewhere (a trainer built in a helper
    thread) the request stays inert and the signals keep their previous behaviour. :meth:`restore`
    puts the previous handlers back.

    Args:
        device: where the all-reduce tensor lives (the rank's training device).
        distributed: whether a default process group exists (False: one process, no collective).
    """

    def __init__(self, device: torch.device, distributed: bool):
        self.device = device
        self.distributed = distributed
        self.received = 0  # signal number, 0 = none
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: SIGTERM/SIGUSR1 handlers not installed")
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        # Only record it: collectives and file I/O are not safe inside a signal handler.
        self.received = max(self.received, int(signum))

    def agreed(self) -> str | None:
        """The signal name (e.g. "SIGTERM") when any rank has received one, else None.

        Collective over the default process group when distributed: call it on every rank at the
        same point of every step.
        """
        value = self.received
        if self.distributed:
            flag = torch.tensor([value], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            value = int(flag.item())
        return signal.Signals(value).name if value else None

    def restore(self) -> None:
        """Reinstall the handlers that were active before (safe to call twice)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
