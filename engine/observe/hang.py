"""Hang watchdog: a rank that makes no progress for ``comm.hang_timeout_seconds`` leaves its evidence
and ends the attempt.

A collective waits for every rank of its group; one rank that never arrives (a stuck kernel, a
deadlocked thread, a dead NIC) holds all others, silently, until the process-group timeout. The
trainer calls :meth:`HangWatchdog.beat` at every step (engine/train/trainer.py); a daemon thread
checks the time since the last beat and, past the timeout, writes

- ``<run folder>/hangs/attempt-K/rank-R.txt``: every Python thread's stack (``faulthandler``,
  docs.python.org/3/library/faulthandler.html);
- ``rank-R.fr.json``: torch's Flight Recorder record of the recent collectives of every process
  group (``torch._C._distributed_c10d._dump_fr_trace_json``: gloo and NCCL; it records when
  ``TORCH_FR_BUFFER_SIZE`` > 0 is set before the process group is created, which the launcher does),

then, once every rank's record is there (or :data:`RECORD_WAIT_S` passed), exits with
:data:`HANG_EXIT`. Every rank's watchdog fires, the stuck one's too (the thread runs while its main
thread sleeps or waits), within a poll of each other; a rank must not end before the others wrote:
torchrun's agent stops every rank as soon as one exits, and the records the verdict compares would
be lost (seen: only the sleeping rank's record, and the verdict "no rank progressed"). The launcher
(engine/launch/elastic.py) compares the records with :func:`missing_ranks`: per process group, the
ranks whose newest collective sequence number is below the others' never entered the collective the
others wait in.

:func:`test_hook` holds the test suite's real faults (``QUADRA_TEST_FAULT``): a rank that sleeps instead
of entering the step's first collective, a rank stopped (SIGSTOP: it writes no record; the launcher's
agent marks it ``rank-R.frozen``, which :func:`recorded_ranks` counts, engine/launch/frozen.py), a rank
or a node killed at a given step.
"""

from __future__ import annotations

import faulthandler
import glob
import json
import logging
import os
import signal
import threading
import time

logger = logging.getLogger("quadra")

HANG_EXIT = 124  # the exit status of a rank ended by its hang watchdog (timeout(1)'s convention)
FR_BUFFER = "2000"  # Flight Recorder entries per process group the launcher asks for
RECORD_WAIT_S = 30.0  # how long a rank that wrote its hang record waits for the other ranks' records


def hang_folder(run_folder: str, attempt: int) -> str:
    """``<run folder>/hangs/attempt-<attempt>``: where each rank of that attempt writes its record."""
    return os.path.join(run_folder, "hangs", f"attempt-{attempt}")


def attempt_number() -> int:
    """The attempt of this process: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


class HangWatchdog:
    """The watchdog thread of one rank (module docstring).

    Args:
        timeout_s: seconds without a :meth:`beat` after which the rank is hung; <= 0: no watchdog.
        run_folder: the run folder (records go to ``hangs/attempt-K`` in it).
        rank: this global rank.
        exit: called with :data:`HANG_EXIT` after the records are written (``os._exit``; tests pass
            another callable).
        world_size: ranks whose records (``rank-R.txt``) are awaited before ``exit``.

    The thread checks every ``min(1 s, timeout_s / 4)``: it fires at most that long after the timeout.
    """

    def __init__(self, timeout_s: float, run_folder: str, rank: int, exit=os._exit, world_size: int = 1):
        self.timeout_s, self.rank, self._exit, self.world_size = timeout_s, rank, exit, world_size
        self.folder = hang_folder(run_folder, attempt_number())
        self._last = time.monotonic()
        self._step = 0
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0:
            # daemon: a run that ends without close() must not wait for it; the name is only a label for a
            # debugger (threading.enumerate, py-spy): faulthandler's stacks and every record go without it
            self._thread = threading.Thread(target=self._watch, name="quadra-hang-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        """Progress: ``step`` (the step about to run or just done) is where a hang would be."""
        self._last, self._step = time.monotonic(), step

    def close(self) -> None:
        """Stop watching (the run ends; waiting for a checkpoint to finish is not a hang)."""
        self._stop.set()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:  # (>= alike: a float clock is never exactly at the timeout)
                try:
                    self._report(idle)
                    await_records(self.folder, self.world_size, RECORD_WAIT_S)
                except OSError as error:  # the attempt still ends, and says why this record is missing
                    logger.error(f"rank {self.rank}: no hang record written to {self.folder}: {error}")
                finally:
                    self._exit(HANG_EXIT)
                return

    def _report(self, idle: float) -> None:
        """Write this rank's Flight Recorder record, then its stacks (the .txt last: its presence
        tells the launcher the record is complete)."""
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank-{self.rank}")
        trace = _flight_recorder()
        if trace is not None:
            with open(path + ".fr.json.tmp", "w") as f:
                f.write(trace)
            os.replace(path + ".fr.json.tmp", path + ".fr.json")
        with open(path + ".txt.tmp", "w") as f:
            f.write(f"rank {self.rank}: no progress for {idle:.1f} s in step {self._step} "
                    f"(comm.hang_timeout_seconds = {self.timeout_s:g}); stacks of every thread:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)  # (True is also its default)
        os.replace(path + ".txt.tmp", path + ".txt")


def _flight_recorder() -> str | None:
    """torch's Flight Recorder dump as JSON, or None where it cannot be had."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = _dump_fr_trace_json()
        return trace.decode() if isinstance(trace, bytes) else trace
    except Exception as error:  # noqa: BLE001 - a missing record must not prevent the stack dump
        logger.debug("no Flight Recorder record: %s", error)
        return None


def recorded_ranks(folder: str) -> set[int]:
    """Ranks with a complete record in ``folder``: their own (``rank-R.txt``, written last) or the mark
    ``rank-R.frozen`` the launcher's agent writes for a rank that is stopped and cannot write one
    (engine/launch/frozen.py)."""
    ranks = set()
    for path in glob.glob(os.path.join(folder, "rank-*.txt")) + glob.glob(os.path.join(folder, "rank-*.frozen")):
        # (rpartition alike: the records written, rank-R.txt and rank-R.frozen, have one dot)
        name = os.path.basename(path)[5:].partition(".")[0]
        if name.isdigit():
            ranks.add(int(name))
    return ranks


def await_records(folder: str, world_size: int, timeout_s: float) -> None:
    """Wait until ``folder`` holds the records (:func:`recorded_ranks`) of ``world_size`` ranks, at
    most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    # (<= alike for the deadline: a float clock is never exactly at it)
    while len(recorded_ranks(folder)) < world_size and time.monotonic() < deadline:
        time.sleep(0.1)


def missing_ranks(folder: str) -> tuple[list[int], str, list[int]] | None:
    """(ranks that waited, the collective they waited in, ranks that never entered it) from the
    Flight Recorder records in ``folder``; None when the records show no such collective.

    Per process group, each rank's newest collective sequence number (``collective_seq_id``,
    point-to-point operations aside) is compared: the ranks below the group's newest never called
    it. Of several such groups, the collective created last is the one the others wait in."""
    newest: dict[str, dict[int, tuple[int, int, str]]] = {}  # group -> rank -> (seq, created_ns, op)
    for path in glob.glob(os.path.join(folder, "rank-*.fr.json")):
        rank = int(os.path.basename(path)[5:-8])
        try:
            with open(path) as f:
                entries = json.load(f).get("entries", [])
        except (OSError, ValueError):
            continue
        for entry in entries:
            if entry.get("is_p2p"):
                continue
            group = "/".join(map(str, entry.get("process_group", ["?"])))
            seq = int(entry.get("collective_seq_id", 0))
            mine = newest.setdefault(group, {})
            # (> alike for >=: each collective of a group has its own collective_seq_id, and the p2p
            # entries that repeat it are skipped; any negative start alike: sequence numbers are >= 0)
            if seq >= mine.get(rank, (-1,))[0]:
                # (a missing time: 0 or 1 alike, both before any real time, Unix-epoch nanoseconds)
                mine[rank] = (seq, int(entry.get("time_created_ns", 0)), str(entry.get("profiling_name", "?")))
    found = []
    for group, ranks in newest.items():
        top = max(seq for seq, _, _ in ranks.values())
        waiting = sorted(r for r, (seq, _, _) in ranks.items() if seq == top)
        missing = sorted(r for r, (seq, _, _) in ranks.items() if seq < top)
        if missing:
            created, op = max((ranks[r][1], ranks[r][2]) for r in waiting)
            name = group.split("/")[-1] if not group.endswith("undefined") else group.split("/")[0]
            found.append((created, waiting, f"{op} #{top} of process group {name}", missing))
    if not found:
        return None
    _, waiting, collective, missing = max(found)
    return waiting, collective, missing


def test_hook(step: int, rank: int, wait_for_every_group=None) -> None:
    """The test suite's real faults, each in one attempt (a restarted attempt runs on), at the start of
    a step, before its first collective. ``QUADRA_TEST_FAULT=KIND:RANK:STEP[@ATTEMPT][:GROUP]`` (RANK
    ``any``: every rank of this node; ATTEMPT: the launch attempt it fires in, default 0, so one run
    can meet a second fault after its first restart; GROUP: only in that torchft replica group,
    ``QUADRA_REPLICA_ID``): ``hang``
    sleeps (its watchdog thread runs), ``stop`` sends the rank SIGSTOP (nothing of it runs: no record),
    ``kill`` SIGKILLs the rank, ``kill_node`` SIGKILLs the rank's launcher (the node is gone for
    good; its ranks follow it), ``rejoin`` calls ``wait_for_every_group`` (a torchft group's next
    quorum waits for every group: a restarted one rejoins at this step, however long its restart
    takes), ``abort`` calls ``os.abort()`` (SIGABRT), ``segv`` reads address 0 (SIGSEGV), ``double_free``
    frees one malloc block twice (glibc's ``free(): double free detected ...``, then SIGABRT); several
    faults are comma-separated. No-op otherwise."""
    specs = os.environ.get("QUADRA_TEST_FAULT")
    if not specs:
        return
    for spec in specs.split(","):  # several faults: comma-separated
        kind, fault_rank, fault_step, *group = spec.split(":")
        fault_step, _, attempt = fault_step.partition("@")
        if (group and group[0] != os.environ.get("QUADRA_REPLICA_ID")) or fault_rank not in ("any", str(rank)) \
                or int(attempt or 0) != attempt_number():
            continue
        if int(fault_step) == step and kind == "rejoin" and wait_for_every_group is not None:
            wait_for_every_group()
        elif int(fault_step) == step and kind == "hang":
            time.sleep(24 * 3600)
        elif int(fault_step) == step and kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, the watchdog's too
        elif int(fault_step) == step and kind in ("kill", "kill_node"):
            os.kill(os.getppid() if kind == "kill_node" else os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal ends this process (kill_node: through die_with_parent)
        elif int(fault_step) == step and kind in ("abort", "segv", "double_free"):
            _crash(kind)


def _crash(kind: str) -> None:
    """Crash this process as native code would: ``abort``, ``segv`` or ``double_free`` (see test_hook)."""
    import ctypes

    if kind == "abort":
        os.abort()
    if kind == "segv":
        ctypes.string_at(0)
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(64)
    libc.free(block)
    libc.free(block)
    os.abort()  # where the allocator did not notice
