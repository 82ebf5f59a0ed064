"""Background read-ahead: one thread gathers a rank's next microbatches in order into a bounded queue.

The window positions a rank reads are a fixed function of the loader state (engine/data/loader.py),
so a producer thread can walk them ahead of the training loop and the loop only takes finished
batches from the queue. numpy's fancy indexing and the page faults of memory-mapped shards release
the GIL, and so do torch's kernels in the step, so the reading overlaps the compute. The queue
holds at most ``depth`` microbatches (memory bound: depth x L x (S + 1) x 4 bytes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch


class ReadAhead:
    """Gathers ``gather(start)`` for each ``start`` of ``starts`` in a daemon thread.

    Args:
        gather: first window position -> the microbatch's windows (called in the thread only).
        starts: the first window positions, in the order they will be asked for; may end.
        depth: microbatches kept ready.
    """

    def __init__(self, gather: Callable[[int], torch.Tensor], starts: Iterator[int], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gather, starts), daemon=True,
                                        name="quadra-data-read-ahead")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, gather, starts) -> None:
        try:
            for start in starts:
                if not self._put((start, gather(start))):
                    return
            self._put(("end", None))
        except BaseException as error:  # noqa: BLE001 - re-raised in the training thread by get()
            self._put((None, error))

    def get(self, start: int) -> torch.Tensor | None:
        """The microbatch at ``start``; None if the thread has moved on to other positions (the
        caller then reads it itself and restarts the read-ahead).

        Raises:
            whatever ``gather`` raised in the thread.
        """
        got, value = self._queue.get()
        if got is None:
            raise value
        return value if got == start else None

    def close(self) -> None:
        """Stop the thread and drop what it read."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
