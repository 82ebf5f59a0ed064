"""Graceful stop on SIGTERM / SIGUSR1 / SIGINT: every rank finishes its step, then all stop together.

A scheduler that preempts a job (SLURM sends SIGUSR1 or SIGTERM ahead of the kill), a container
runtime, ``kill -- -<pgid>`` or Ctrl-C may reach the ranks at different moments, some of them twice
(directly and forwarded by the launcher), or only some of them. The handler only records the signal;
after each step the trainer calls :meth:`StopRequest.agreed`, an all-reduce (MAX) of the recorded
signal number, so all ranks see the same answer at the same step and save one checkpoint together.

SIGINT: the first one is a stop request like SIGTERM. Under ``engine.launch`` (``QUADRA_LAUNCHER``
set) later ones are ignored here, because the launcher counts Ctrl-C presses and ends the ranks
itself on the second; a rank started otherwise (plain torchrun, one process) raises
``KeyboardInterrupt`` on the second SIGINT.

The handlers are installed by :func:`install` as early as possible (engine/train/main.py does it before
set-up), so a signal during set-up is not lost: training then stops before its first step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger("quadra")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_state = {"received": 0, "interrupts": 0}  # module-level: shared by install() and every StopRequest
_previous: dict[int, object] = {}


def _handle(signum: int, frame) -> None:
    # Only record it: collectives and file I/O are not safe inside a signal handler.
    if signum == signal.SIGINT:
        _state["interrupts"] += 1
        if _state["interrupts"] > 1:
            if os.environ.get("QUADRA_LAUNCHER"):
                return  # the launcher decides what a second Ctrl-C does
            raise KeyboardInterrupt
    if not _state["received"]:
        _state["received"] = int(signum)


def install() -> bool:
    """Install the recording handlers (idempotent); False outside the main thread, where Python
    does not allow it (the signals then keep their previous behaviour)."""
    if _previous:
        return True
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread: stop-signal handlers not installed")
        return False
    for sig in STOP_SIGNALS:
        _previous[sig] = signal.signal(sig, _handle)
    return True


def restore() -> None:
    """Reinstall the handlers that were active before :func:`install` and forget any signal."""
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
    _state.update(received=0, interrupts=0)


class StopRequest:
    """Turns the recorded stop signal into a decision of all ranks.

    Args:
        device: where the all-reduce tensor lives (the rank's training device).
        distributed: whether a default process group exists (False: one process, no collective).
    """

    def __init__(self, device, distributed: bool):
        self.device = device
        self.distributed = distributed
        install()

    @property
    def received(self) -> int:
        """The first stop signal this process received (signal number), 0 = none."""
        return _state["received"]

    def agreed(self) -> str | None:
        """The signal name (e.g. "SIGTERM") when any rank has received one, else None.

        Collective over the default process group when distributed: call it on every rank at the
        same point of every step. With several signals on different ranks the largest number wins.
        """
        value = self.received
        if self.distributed:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([value], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            value = int(flag.item())
        return signal.Signals(value).name if value else None

    def restore(self) -> None:
        """Reinstall the previous handlers (safe to call twice); see :func:`restore`."""
        restore()
